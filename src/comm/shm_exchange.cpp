// shm_exchange.cpp — small sums through an MPI-3 shared-memory window (see shm_exchange.h).
#include "comm/shm_exchange.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <system_error>
#include <thread>
#include <utility>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "comm/mpi_check.h"
#include "common/check.h"

namespace tpnorm::detail {

std::string count_mismatch_message(const std::vector<int>& counts) {
  std::string s =
      "tpnorm: all_reduce_sum: the ranks disagree on the size of a sum: counts by rank [";
  for (size_t r = 0; r < counts.size(); ++r) s += (r ? ", " : "") + std::to_string(counts[r]);
  return s + "]";
}

bool ShmExchange::enabled_by_env() {
  const char* v = std::getenv("TPNORM_SHM");
  return !(v && std::strcmp(v, "0") == 0);
}

std::unique_ptr<ShmExchange> ShmExchange::create(MPI_Comm comm, int rank, int size,
                                                 size_t max_bytes, bool want) {
  if (size < 2) return nullptr;  // nothing to exchange (the same answer on every rank)
  // Every rank on this node? Each rank's node group is the whole communicator, or none is.
  MPI_Comm node = MPI_COMM_NULL;
  TPNORM_CHECK(MPI, MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
  int node_size = 0;
  MPI_Comm_size(node, &node_size);
  MPI_Comm_free(&node);
  // TPNORM_SHM may differ between ranks: the minimum decides for all of them.
  int on = want && node_size == size;
  TPNORM_CHECK(MPI, MPI_Allreduce(MPI_IN_PLACE, &on, 1, MPI_INT, MPI_MIN, comm));
  if (!on) return nullptr;
  return std::unique_ptr<ShmExchange>(new ShmExchange(comm, rank, size, max_bytes));
}

// Open MPI's segments start 8-byte aligned (its header precedes them); a ring starts at the next
// 64 bytes. A mapping starts on a page in every process, so every process finds the same ring
// in a peer's segment.
static char* aligned(char* p) { return p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64; }

ShmExchange::ShmExchange(MPI_Comm comm, int rank, int size, size_t max_bytes)
    : rank_(rank), size_(size), max_bytes_(max_bytes) {
  if (const char* v = std::getenv("TPNORM_SHM_TEST_ADD_DELAY_US")) test_add_delay_us_ = std::atoi(v);
  stride_ = kDataOffset + (max_bytes + 63) / 64 * 64;
  // Each rank's ring in memory near it (no need for one contiguous block).
  MPI_Info info;
  MPI_Info_create(&info);
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  char* mine = nullptr;
  const int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(kSlots * stride_ + 64), 1, info,
                                         comm, &mine, &win_);
  MPI_Info_free(&info);
  TPNORM_CHECK(MPI, rc);
  mine = aligned(mine);
  for (uint64_t s = 0; s < kSlots; ++s) {
    char* at = mine + s * stride_;
    new (at) Head{};
    new (at + sizeof(Head)) Reads{};
    reinterpret_cast<Head*>(at)->seq.store(0, std::memory_order_relaxed);
    reinterpret_cast<Head*>(at)->count.store(0, std::memory_order_relaxed);
    reinterpret_cast<Reads*>(at + sizeof(Head))->reads.store(0, std::memory_order_relaxed);
  }
  bases_.resize(static_cast<size_t>(size));
  for (int q = 0; q < size; ++q) {
    MPI_Aint bytes = 0;
    int unit = 0;
    void* base = nullptr;
    TPNORM_CHECK(MPI, MPI_Win_shared_query(win_, q, &bytes, &unit, &base));
    bases_[static_cast<size_t>(q)] = aligned(static_cast<char*>(base));
  }
  // Loads and stores into the window are this passive-target epoch's accesses (MPI-3's
  // unified model); the barrier orders every rank's zeroed ring before any peer reads it.
  TPNORM_CHECK(MPI, MPI_Win_lock_all(MPI_MODE_NOCHECK, win_));
  MPI_Win_sync(win_);
  TPNORM_CHECK(MPI, MPI_Barrier(comm));
}

ShmExchange::~ShmExchange() {
  // Every sum was completed by its wait (or the communicator's destructor): the thread holds
  // nothing it still has to add.
  if (worker_.joinable()) {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || win_ == MPI_WIN_NULL) return;
  MPI_Win_unlock_all(win_);
  MPI_Win_free(&win_);  // each process unmaps its own view: peers still reading keep theirs
}

std::vector<std::shared_ptr<ShmExchange::Sum>>::iterator ShmExchange::find(uint64_t n) {
  return std::find_if(sums_in_flight_.begin(), sums_in_flight_.end(),
                      [&](const std::shared_ptr<Sum>& s) { return s->n == n; });
}

template <class Ready>
void ShmExchange::spin(Ready ready, Idle& idle) {
  // Tight at first (a peer that is running publishes within microseconds); then yield the
  // core, since ranks may outnumber cores (CI oversubscribes) and the peer needs it.
  for (unsigned i = 1; !ready(); ++i) {
    if (i % 64 == 0) idle();
    if (i > 1024) std::this_thread::yield();
  }
}

void ShmExchange::start(uint64_t n, void* buf, int count, DType dtype, Idle& idle) {
  const uint64_t s = n % kSlots;
  if (uses_[s] > 0) {
    // The slot's last sum must have been read by every peer. Complete this rank's own copy of
    // it first (see the header: then every peer that gets here reads it too).
    const auto old = find(last_[s]);
    if (old != sums_in_flight_.end()) collect(**old, idle);
    const uint64_t need = uses_[s] * static_cast<uint64_t>(size_ - 1);
    std::atomic<uint64_t>& r = reads(rank_, n).reads;
    spin([&] { return r.load(std::memory_order_acquire) >= need; }, idle);
  }
  const size_t bytes = static_cast<size_t>(count) * dtype_size(dtype);
  std::memcpy(slot(rank_, n) + kDataOffset, buf, std::min(bytes, max_bytes_));
  Head& h = head(rank_, n);
  h.count.store(static_cast<uint64_t>(count), std::memory_order_relaxed);
  h.seq.store(n + 1, std::memory_order_release);  // publishes count and data
  ++uses_[s];
  last_[s] = n;
  std::shared_ptr<Sum> sum = fresh_sum();
  sum->n = n;
  sum->buf = buf;
  sum->count = count;
  sum->dtype = dtype;
  sums_in_flight_.push_back(std::move(sum));
  ++sums_;
}

bool ShmExchange::peers_ready(uint64_t n) const {
  for (int q = 0; q < size_; ++q)
    if (q != rank_ && head(q, n).seq.load(std::memory_order_acquire) < n + 1) return false;
  return true;
}

void ShmExchange::collect(Sum& s, Idle& idle) {
  int open = kOpen;
  if (s.state.compare_exchange_strong(open, kClaimed, std::memory_order_acq_rel)) {
    spin([&] { return peers_ready(s.n); }, idle);
    reduce(s, counts_);
  } else {  // the progress thread has it (claimed: adding now) or is done with it
    spin([&] { return s.state.load(std::memory_order_acquire) == kDone; }, idle);
  }
}

void ShmExchange::reduce(Sum& s, std::vector<int>& counts) {
  const uint64_t want = s.n + 1;
  counts.assign(static_cast<size_t>(size_), s.count);
  int foreign = -1;  // a peer whose slot holds a later sum: not in step with this protocol
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    if (head(q, s.n).seq.load(std::memory_order_acquire) != want) {
      foreign = q;
      continue;
    }
    const uint64_t c = head(q, s.n).count.load(std::memory_order_relaxed);
    counts[static_cast<size_t>(q)] =
        c > static_cast<uint64_t>(INT32_MAX) ? -1 : static_cast<int>(c);
  }
  const bool same = std::all_of(counts.begin(), counts.end(), [&](int c) { return c == s.count; });
  if (foreign >= 0) {
    s.code = ErrorCode::kCommunication;
    s.error = "tpnorm: all_reduce_sum: rank " + std::to_string(rank_) +
              " could not receive the contribution of rank " + std::to_string(foreign) +
              " (its shared-memory slot holds a later sum)";
  } else if (!same) {
    s.code = ErrorCode::kMismatch;  // every rank read the same counts: the same text
    s.error = count_mismatch_message(counts);
  } else if (s.dtype == DType::F64) {
    add_in_rank_order(static_cast<double*>(s.buf), s.n, s.count);
  } else if (s.dtype == DType::I64) {
    add_in_rank_order(static_cast<int64_t*>(s.buf), s.n, s.count);
  } else {  // F32 (mpi_type refused the rest before the sum started)
    add_in_rank_order(static_cast<float*>(s.buf), s.n, s.count);
  }
  // After the last load of the peers' data: each may now reuse its slot.
  for (int q = 0; q < size_; ++q)
    if (q != rank_) reads(q, s.n).reads.fetch_add(1, std::memory_order_release);
  // Before kDone: a later sum on this word starts only after this one is done, so the word
  // only grows (see the header).
  if (s.error.empty() && done_words_)
    done_words_[s.n % kSlots].store(s.n + 1, std::memory_order_release);  // buf is the waiter's
  s.state.store(kDone, std::memory_order_release);  // buf, code and error are the waiter's
}

// A wait after long work finds every line and page it touches cold (each costs about a
// microsecond on a virtual machine), so the wait path touches few: no allocation, no
// reference counting; the finished record is kept for a later start.
void ShmExchange::finish(uint64_t n, Idle& idle, bool may_throw) {
  const auto it = find(n);
  if (it == sums_in_flight_.end()) return;
  Sum& s = **it;
  collect(s, idle);
  const ErrorCode code = s.code;
  std::string error = std::move(s.error);
  if (spare_.size() < kSpares) spare_.push_back(std::move(*it));
  sums_in_flight_.erase(it);
  if (!error.empty() && may_throw) throw Error(code, error);
}

std::shared_ptr<ShmExchange::Sum> ShmExchange::fresh_sum() {
  for (auto it = spare_.begin(); it != spare_.end(); ++it) {
    if ((*it)->with_thread.load(std::memory_order_acquire)) continue;  // the thread uses it
    std::shared_ptr<Sum> s = std::move(*it);
    spare_.erase(it);
    s->state.store(kOpen, std::memory_order_relaxed);
    s->handed = false;
    s->code = ErrorCode::kMismatch;
    s->error.clear();
    return s;
  }
  return std::make_shared<Sum>();
}

void ShmExchange::progress_in_background() {
  std::vector<std::shared_ptr<Sum>> fresh;
  for (const std::shared_ptr<Sum>& s : sums_in_flight_)
    if (!s->handed && s->state.load(std::memory_order_relaxed) == kOpen) fresh.push_back(s);
  if (fresh.empty()) return;
  if (!worker_.joinable()) {
    try {
      worker_ = std::thread([this] { work(); });
    } catch (const std::system_error&) {
      return;  // no thread: the waits add the sums, as without this call
    }
  }
  for (const std::shared_ptr<Sum>& s : fresh) {
    s->handed = true;
    s->with_thread.store(true, std::memory_order_relaxed);  // published by mu_ below
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    queue_.insert(queue_.end(), fresh.begin(), fresh.end());
  }
  cv_.notify_one();
}

void ShmExchange::work() {
#if defined(__linux__)
  prctl(PR_SET_TIMERSLACK, 1000UL);  // 1 us: the pauses below are short on purpose
#endif
  const auto delay = std::chrono::microseconds(test_add_delay_us_);
  std::vector<std::shared_ptr<Sum>> held;  // handed over, not yet done (start order)
  std::vector<int> counts;
  unsigned misses = 0;  // polls in a row that found nothing to add
  for (;;) {
    {
      std::unique_lock<std::mutex> l(mu_);
      if (held.empty()) {
        cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
      } else if (misses > 64) {  // pause 10, 20, ... 200 us (new sums or stop end it early)
        const unsigned k = std::min(misses - 64, 6u);
        const auto pause = std::chrono::microseconds(std::min(5u << k, 200u));
        cv_.wait_for(l, pause, [&] { return stop_ || !queue_.empty(); });
      }
      if (stop_) return;
      held.insert(held.end(), queue_.begin(), queue_.end());
      queue_.clear();
    }
    bool added = false;
    for (size_t i = 0; i < held.size();) {
      Sum& s = *held[i];
      bool drop = s.state.load(std::memory_order_acquire) != kOpen;  // the caller has it
      if (!drop && peers_ready(s.n)) {
        int open = kOpen;
        if (s.state.compare_exchange_strong(open, kClaimed, std::memory_order_acq_rel)) {
          if (delay.count() > 0) std::this_thread::sleep_for(delay);
          reduce(s, counts);
          background_sums_.fetch_add(1, std::memory_order_relaxed);
          added = true;
        }
        drop = true;
      }
      if (drop) {
        s.with_thread.store(false, std::memory_order_release);  // its last access: reusable
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
    misses = added ? 0 : misses + 1;
  }
}

// Ranks 0..P-1 in that order, every rank's contribution read from its slot (this rank's own
// copy too, so `out` — this rank's buffer — can take the running sum): per element
// ((c0 + c1) + c2) + ..., the additions of the MPI exchange, so both paths give the same bits.
// One pass per peer keeps the loops simple enough to vectorize.
template <class T>
void ShmExchange::add_in_rank_order(T* out, uint64_t n, int count) const {
  auto in = [&](int r) { return reinterpret_cast<const T*>(slot(r, n) + kDataOffset); };
  const T* c0 = in(0);
  const T* c1 = in(1);
  for (int i = 0; i < count; ++i) out[i] = c0[i] + c1[i];
  for (int r = 2; r < size_; ++r) {
    const T* c = in(r);
    for (int i = 0; i < count; ++i) out[i] += c[i];
  }
}

}  // namespace tpnorm::detail
