// shm_exchange.cpp — small sums through an MPI-3 shared-memory window (see shm_exchange.h).
#include "comm/shm_exchange.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>
#include <utility>

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
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || win_ == MPI_WIN_NULL) return;
  MPI_Win_unlock_all(win_);
  MPI_Win_free(&win_);  // each process unmaps its own view: peers still reading keep theirs
}

ShmExchange::Sum* ShmExchange::find(uint64_t n) {
  for (Sum& s : sums_in_flight_)
    if (s.n == n) return &s;
  return nullptr;
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
    if (Sum* old = find(last_[s]))
      if (!old->collected) collect(*old, idle);
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
  Sum sum;
  sum.n = n;
  sum.buf = buf;
  sum.count = count;
  sum.dtype = dtype;
  sums_in_flight_.push_back(std::move(sum));
  ++sums_;
}

void ShmExchange::collect(Sum& s, Idle& idle) {
  const uint64_t want = s.n + 1;
  std::vector<int>& counts = counts_;
  counts.assign(static_cast<size_t>(size_), s.count);
  int foreign = -1;  // a peer whose slot holds a later sum: not in step with this protocol
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    std::atomic<uint64_t>& seq = head(q, s.n).seq;
    spin([&] { return seq.load(std::memory_order_acquire) >= want; }, idle);
    if (seq.load(std::memory_order_acquire) != want) {
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
  s.collected = true;
}

void ShmExchange::finish(uint64_t n, Idle& idle, bool may_throw) {
  Sum* s = find(n);
  if (!s) return;
  if (!s->collected) collect(*s, idle);
  const ErrorCode code = s->code;
  std::string error = std::move(s->error);
  sums_in_flight_.erase(sums_in_flight_.begin() + (s - sums_in_flight_.data()));
  if (!error.empty() && may_throw) throw Error(code, error);
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
