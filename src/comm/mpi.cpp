// mpi.cpp — the MPI communicator over host buffers: one all-reduce (MPI_SUM) per call on a
// duplicate of the caller's communicator, blocking (all_reduce_sum) or started now and waited
// later (start_all_reduce_sum / wait: MPI_Iallreduce).
//
// Watchdog: the all-reduce is MPI_Iallreduce completed by polling MPI_Test against a deadline,
// so a collective that a dead or stuck rank never joins ends the job with MPI_Abort and a
// message naming op, rank and call sequence, instead of blocking forever in MPI_Allreduce. No
// extra thread while waiting (MPI_Abort is called from the calling thread; abort_world's timer
// thread and reaper, which never call MPI, start only once the job is being ended); the shared-memory
// exchange's progress thread never calls MPI, so MPI_THREAD_FUNNELED suffices.
// Started sums are completed by the same loop when waited, so the watchdog covers them too.
// Small sums are an exchange instead (see kExchangeBytes): through a shared-memory window
// (comm/shm_exchange.h) when every rank is on this node, else point-to-point messages.
#include "tpnorm/mpi.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <signal.h>
#include <unistd.h>

#include "comm/mpi_check.h"
#include "comm/mpi_util.h"
#include "comm/shm_exchange.h"
#include "common/check.h"

namespace tpnorm {
namespace {

using detail::mpi_type;

// MPI_Abort asks the runtime to end the whole job, and a host that has lost its link to the
// job's mpirun never hears back: its OpenMPI daemon ends the ranks it started there and then
// waits for orders that cannot come, and MPI_Abort itself may block (docs/multi-node.md, faults).
// So an aborting rank first starts a reaper: a process detached by setsid, outside the job's
// process group and holding none of its descriptors, that waits kAbortGraceSeconds for the
// OpenMPI daemon or launcher that started this rank (its nearest such ancestor: a wrapper such
// as `bash -c` may stand in between; under srun there is none, and Slurm's processes are left
// alone) to end, and kills it if it has not. The rank itself exits after the same grace if
// MPI_Abort has not ended it. A job that the runtime ends in time never reaches either.
constexpr int kAbortGraceSeconds = 10;

// The parent of PID and its command name, from /proc; 0 when unknown.
pid_t parent_of(pid_t pid, std::string* name) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto open = stat.find('('), close = stat.rfind(')');
  if (open == std::string::npos || close == std::string::npos) return 0;
  *name = stat.substr(open + 1, close - open - 1);
  int ppid = 0;
  char state = 0;
  return std::sscanf(stat.c_str() + close + 1, " %c %d", &state, &ppid) == 2 ? ppid : 0;
}

// The nearest ancestor of this process that is OpenMPI's daemon or launcher, or 0.
pid_t openmpi_runtime_ancestor() {
  std::string name;
  pid_t p = getppid();
  for (int depth = 0; depth < 8 && p > 1; ++depth) {
    const pid_t up = parent_of(p, &name);
    if (name == "orted" || name == "mpirun" || name == "mpiexec" || name == "orterun" ||
        name == "prted" || name == "prterun")
      return p;
    p = up;
  }
  return 0;
}

// The reaper of RUNTIME (see kAbortGraceSeconds); only async-signal-safe calls after fork.
void start_reaper(pid_t runtime) {
  if (fork() != 0) return;  // this rank, or no reaper when fork failed
  setsid();
  for (int fd = 0; fd < 1024; ++fd) close(fd);
  for (int i = 0; i < kAbortGraceSeconds * 10; ++i) {
    if (kill(runtime, 0) != 0) _exit(0);
    usleep(100000);
  }
  kill(runtime, SIGKILL);
  _exit(0);
}

[[noreturn]] void abort_world(int code) {
  if (const pid_t runtime = openmpi_runtime_ancestor()) start_reaper(runtime);
  std::thread([code] {
    std::this_thread::sleep_for(std::chrono::seconds(kAbortGraceSeconds));
    std::_Exit(code);
  }).detach();
  MPI_Abort(MPI_COMM_WORLD, code);  // the whole job, not only this group
  std::_Exit(code);                 // MPI_Abort does not return; if it ever did, end anyway
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm parent) {
    detail::dup_comm(parent, &comm_, &rank_, &size_);
    // Collective (every rank constructs): the window, or nullptr on every rank alike.
    shm_ = detail::ShmExchange::create(comm_, rank_, size_, size_checked_sum_bytes(),
                                       detail::ShmExchange::enabled_by_env());
    if (shm_) shm_->set_completion_words(done_words_);
    // Every call checks the header first: its sum is non-blocking and hides under the partial
    // (see docs/split-phase.md, the cost of checking every call).
    set_default_strict_calls(-1);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    // Sums started and never waited: complete them (the peers started them too) before the
    // communicator goes, so that no request outlives it. Errors cannot be thrown from here.
    // (Sums waited on the quick path are among them: their completion finds them done.)
    for (Pending& p : pending_) complete(p, /*may_throw=*/false);
    for (Retired& r : retired_)
      MPI_Waitall(static_cast<int>(r.reqs.size()), r.reqs.data(), MPI_STATUSES_IGNORE);
    shm_.reset();  // collective, like the communicator's free
    MPI_Comm_free(&comm_);
  }
  [[noreturn]] void abort_job(const std::string& message) override {
    std::fprintf(stderr, "%s\n", message.c_str());
    std::fflush(stderr);
    abort_world(1);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cpu(); }
  size_t size_checked_sum_bytes() const override {
    return size_ > 1 ? kExchangeBytes / static_cast<size_t>(size_ - 1) : SIZE_MAX;
  }
  uint64_t shared_memory_sums() const { return shm_ ? shm_->sums() : 0; }
  uint64_t background_sums() const { return shm_ ? shm_->background_sums() : 0; }
  using Communicator::quick_waits;

 protected:
  void do_all_reduce_sum(void* buf, size_t count, DType dtype) override {
    settle_quick_waits();
    if (!(timeout() > 0) &&
        !(shm_ && exchanges(count * dtype_size(dtype)))) {  // watchdog off: the blocking call,
                                                            // which costs less (docs/split-phase.md)
      const MPI_Datatype type = mpi_type(dtype);
      for_each_chunk(buf, count, dtype, [&](void* at, int n) {
        TPNORM_CHECK(MPI, MPI_Allreduce(MPI_IN_PLACE, at, n, type, MPI_SUM, comm_));
      });
      return;
    }
    Pending p = start(0, buf, count, dtype);
    complete(p, true);
  }
  void do_start_all_reduce_sum(uint64_t id, void* buf, size_t count, DType dtype) override {
    settle_quick_waits();
    pending_.push_back(start(id, buf, count, dtype));
    const Pending& p = pending_.back();
    if (p.shm) note_quick_wait(id, &done_words_[p.nth % detail::ShmExchange::kSlots], p.nth + 1);
  }
  // Only the shared-memory sums have a progress thread: the MPI paths progress inside MPI
  // calls, which only this thread makes.
  void do_progress_in_background() override {
    if (shm_) shm_->progress_in_background();
  }
  void do_wait(uint64_t id) override {
    settle_quick_waits();
    complete_pending(id, /*may_throw=*/true);
  }

 private:
  // Same exit status as `timeout`: the job ran out of time.
  static constexpr int kWatchdogExitCode = 124;

  // One started sum: its MPI requests (one per chunk of at most 2^30 elements, or the
  // exchange's receives then sends) and what the watchdog names if it never completes.
  struct Pending {
    uint64_t id = 0;
    std::vector<MPI_Request> reqs;
    const char* op = nullptr;
    uint64_t sequence = 0;
    // Through the shared-memory window: sum number nth of shm_ (nothing else below is used).
    bool shm = false;
    uint64_t nth = 0;
    // The exchange (see start): the sum's buffer and the other ranks' contributions.
    bool exchange = false;
    int pieces = 0;            // messages per peer (of this rank's own count)
    int receives = 0;          // reqs[0, receives) are receives, the rest sends
    std::vector<double> send;  // the copy the sends read: [count, values...]
    void* buf = nullptr;
    int count = 0;
    DType dtype = DType::F64;
    int tag = 0;               // of the first pieces; tag + 1 for the rest
    size_t slot = 0;           // bytes per peer in recv: room for a first piece at least
    std::vector<double> recv;  // (P - 1) contributions, 8-byte aligned for either type
  };

  // Small sums go as an exchange instead of MPI_Iallreduce: every rank sends its buffer to
  // every other rank when the sum starts, and adds the P contributions in rank order when it
  // is waited (the same additions in the same order on every rank, so every rank gets the
  // same bits). Open MPI's non-blocking all-reduce advances only inside MPI calls, so its
  // later rounds (a reduce to a root, then a broadcast, for small sums) wait for the wait
  // call: work done between start and wait hides one round at most. The exchange has one
  // round, posted at start, so the wait finds the contributions there (messages up to the
  // shared-memory eager size, 4 KiB by default, need nothing of the receiver to be
  // delivered). Bytes per rank: (P - 1) x the buffer, hence the limit.
  //
  // Each contribution says its own length: element 0 of the message is the sender's count
  // (exact in every wire type: at most 2^14 values fit the limit), and a receiver posts only
  // the first piece of each peer at start (room for a whole piece) and the others once it has
  // read the count. So ranks that pass different counts never truncate a message nor match a
  // later sum's pieces: every rank receives exactly what each peer sent, sees that some peer's
  // count differs from its own (if the counts are not all equal, every rank holds one that
  // differs), and throws kMismatch; the next sum starts clean. size_checked_sum_bytes() tells
  // the ops (PackedCall folds its agreement header into such a sum).
  static constexpr size_t kExchangeBytes = size_t{64} << 10;
  // An exchange's first pieces go with tag kExchangeTag + 2 * (its start number mod
  // kExchangeTags), the rest with that + 1 (MPI guarantees tags up to 32767).
  static constexpr int kExchangeTag = 7400, kExchangeTags = 8192;
  static constexpr size_t kPieceBytes = 2048;

  // MPI counts are int: large buffers go in chunks (the same split on every rank).
  template <class F>
  static void for_each_chunk(void* buf, size_t count, DType dtype, F&& f) {
    constexpr size_t kChunk = size_t{1} << 30;
    char* p = static_cast<char*>(buf);
    for (size_t done = 0; done < count; done += kChunk) {
      const size_t n = count - done < kChunk ? count - done : kChunk;
      f(p + done * dtype_size(dtype), static_cast<int>(n));
    }
  }

  Pending start(uint64_t id, void* buf, size_t count, DType dtype) {
    const MPI_Datatype type = mpi_type(dtype);
    Pending p;
    p.id = id;
    p.op = current_op();
    p.sequence = sequence();
    const size_t bytes = count * dtype_size(dtype);
    // Every sum of this communicator, in start order (the same on every rank), so that
    // exchanges in flight together, waited in any order, never take each other's messages.
    const uint64_t nth = started_++;
    if (shm_ && exchanges(bytes)) {
      (void)mpi_type(dtype);  // refuses other types, as the paths below do
      p.shm = true;
      p.nth = nth;
      ShmIdle idle(*this, p);
      shm_->start(nth, buf, static_cast<int>(count), dtype, idle);
      return p;
    }
    if (exchanges(bytes)) {
      p.exchange = true;
      p.tag = kExchangeTag + 2 * static_cast<int>(nth % kExchangeTags);
      p.buf = buf;
      p.count = static_cast<int>(count);
      p.dtype = dtype;
      const size_t elem = dtype_size(dtype), sent = (count + 1) * elem;  // [count, values...]
      p.slot = (std::max(sent, kPieceBytes) + 7) / 8 * 8;
      p.recv.resize(p.slot * static_cast<size_t>(size_ - 1) / 8);
      char* slots = reinterpret_cast<char*>(p.recv.data());
      // In pieces of at most kPieceBytes, each below the shared-memory eager size: a send
      // then completes at once, without the receiver, so a rank's wait never waits for a
      // slower peer to reach its own wait (only for its data, sent when it started the sum).
      const int per_piece = static_cast<int>(kPieceBytes / elem);
      p.pieces = pieces_of(p.count, per_piece);
      // Receives of every peer's first piece (in rank order); the rest once its count is read.
      for (int q = 0, k = 0; q < size_; ++q) {
        if (q == rank_) continue;
        p.reqs.push_back(MPI_REQUEST_NULL);
        TPNORM_CHECK(MPI, MPI_Irecv(slots + static_cast<size_t>(k++) * p.slot, per_piece, type, q,
                                    p.tag, comm_, &p.reqs.back()));
      }
      // Sent from a copy, so that the wait needs only the receives: a send completes when the
      // peer has taken the data, which may be after this rank's wait (the copy lives on in
      // retired_ until then).
      p.send.assign((sent + 7) / 8, 0.0);
      store_count(p.send.data(), dtype, p.count);
      std::memcpy(reinterpret_cast<char*>(p.send.data()) + elem, buf, bytes);
      const char* send = reinterpret_cast<const char*>(p.send.data());
      p.receives = static_cast<int>(p.reqs.size());
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        for (int i = 0; i < p.pieces; ++i) {
          const int n = std::min(per_piece, p.count + 1 - i * per_piece);
          p.reqs.push_back(MPI_REQUEST_NULL);
          TPNORM_CHECK(MPI, MPI_Isend(send + static_cast<size_t>(i) * kPieceBytes, n, type, q,
                                      p.tag + (i > 0), comm_, &p.reqs.back()));
        }
      }
      return p;
    }
    for_each_chunk(buf, count, dtype, [&](void* at, int n) {
      p.reqs.push_back(MPI_REQUEST_NULL);
      TPNORM_CHECK(MPI, MPI_Iallreduce(MPI_IN_PLACE, at, n, type, MPI_SUM, comm_, &p.reqs.back()));
    });
    return p;
  }

  // Waits for a started sum: its MPI_Iallreduce requests, or the exchange's receives (first
  // pieces, then the rest of each peer's pieces as its count says) and the sum in rank order.
  void complete(Pending& p, bool may_throw) {
    if (p.shm) {
      ShmIdle idle(*this, p);
      return shm_->finish(p.nth, idle, may_throw);
    }
    retire_sends(p);  // p.reqs: receives only
    if (!p.exchange) {
      poll(p.reqs, MPI_STATUSES_IGNORE, p, may_throw);
      return;
    }
    const MPI_Datatype type = mpi_type(p.dtype);
    const size_t elem = dtype_size(p.dtype);
    const int per_piece = static_cast<int>(kPieceBytes / elem);
    std::vector<MPI_Status> st(p.reqs.size());
    if (!poll(p.reqs, st.data(), p, may_throw)) return;
    // Every peer's count, and receives for the rest of its pieces: into its slot when the
    // count is this rank's own, else into `drain` (kept apart: only to keep messages in step).
    char* slots = reinterpret_cast<char*>(p.recv.data());
    std::vector<int> counts(static_cast<size_t>(size_ - 1));
    std::vector<std::vector<double>> drain(static_cast<size_t>(size_ - 1));
    std::vector<MPI_Request> rest;
    bool same = true;
    int malformed = -1;
    for (int k = 0; k < size_ - 1; ++k) {
      char* slot = slots + static_cast<size_t>(k) * p.slot;
      int got = 0;
      MPI_Get_count(&st[static_cast<size_t>(k)], type, &got);
      const int c = got > 0 ? load_count(slot, p.dtype) : -1;
      const int pieces = pieces_of(c, per_piece);
      counts[static_cast<size_t>(k)] = c;
      if (c < 0 || got != std::min(per_piece, c + 1) ||
          static_cast<size_t>(c) * elem * static_cast<size_t>(size_ - 1) > kExchangeBytes) {
        malformed = k + (k >= rank_);  // not this protocol's: nothing of it can be drained
        continue;
      }
      same = same && c == p.count;
      char* into = slot;
      if (c != p.count) {
        drain[static_cast<size_t>(k)].resize(static_cast<size_t>(pieces) * kPieceBytes / 8);
        into = reinterpret_cast<char*>(drain[static_cast<size_t>(k)].data());
      }
      const int q = k + (k >= rank_);
      for (int i = 1; i < pieces; ++i) {
        const int n = std::min(per_piece, c + 1 - i * per_piece);
        rest.push_back(MPI_REQUEST_NULL);
        const int rc = MPI_Irecv(into + static_cast<size_t>(i) * kPieceBytes, n, type, q, p.tag + 1,
                                 comm_, &rest.back());
        if (rc != MPI_SUCCESS) rest.pop_back(), malformed = q;
      }
    }
    // Every receive posted above completes before anything is thrown: they write into p and
    // drain, which go with this frame.
    if (!poll(rest, MPI_STATUSES_IGNORE, p, may_throw)) return;
    if (malformed >= 0) {
      if (!may_throw) return;
      throw Error(ErrorCode::kCommunication,
                  "tpnorm: all_reduce_sum: rank " + std::to_string(rank_) +
                      " could not receive the contribution of rank " + std::to_string(malformed));
    }
    if (!same) {
      if (!may_throw) return;
      // Every rank holds every count: the same message everywhere.
      std::vector<int> by_rank(static_cast<size_t>(size_));
      for (int r = 0; r < size_; ++r)
        by_rank[static_cast<size_t>(r)] =
            r == rank_ ? p.count : counts[static_cast<size_t>(r - (r > rank_))];
      throw Error(ErrorCode::kMismatch, detail::count_mismatch_message(by_rank));
    }
    switch (p.dtype) {
      case DType::F64:
        return add_in_rank_order(static_cast<double*>(p.buf), slots + elem, p.slot, p.count);
      case DType::I64:
        return add_in_rank_order(static_cast<int64_t*>(p.buf), slots + elem, p.slot, p.count);
      default:  // F32 (mpi_type refused the rest at start)
        return add_in_rank_order(static_cast<float*>(p.buf), slots + elem, p.slot, p.count);
    }
  }

  // The one wait loop of this communicator: polls MPI_Testall (which also drives MPI's
  // progress for every other request in flight) until done, or until the watchdog's deadline
  // when it is on, then ends the job with MPI_Abort and a message naming the op that started
  // the sum, this rank and its call sequence. False when MPI failed and may_throw is false.
  bool poll(std::vector<MPI_Request>& reqs, MPI_Status* st, const Pending& p, bool may_throw) {
    const int n = static_cast<int>(reqs.size());
    if (n == 0) return true;
    if (!(timeout() > 0)) {
      const int rc = MPI_Waitall(n, reqs.data(), st);
      if (rc != MPI_SUCCESS && may_throw) TPNORM_CHECK(MPI, rc);
      return rc == MPI_SUCCESS;
    }
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + std::chrono::duration<double>(timeout());
    int done = 0;
    // Reading the clock costs ~20 ns; every 64th poll keeps it out of the latency of small calls.
    for (unsigned i = 1;; ++i) {
      const int rc = MPI_Testall(n, reqs.data(), &done, st);
      if (rc != MPI_SUCCESS) {
        if (may_throw) TPNORM_CHECK(MPI, rc);
        return false;
      }
      if (done) return true;
      if (i % 64 == 0 && clock::now() > deadline) {
        std::fprintf(stderr, "%s\n", watchdog_message(p.op, p.sequence).c_str());
        std::fflush(stderr);
        abort_world(kWatchdogExitCode);
      }
    }
  }

  // What a rank does while it waits for its peers' shared-memory slots: the watchdog's check
  // (as in poll) and MPI's progress, which a peer waiting in an MPI_Iallreduce (or for the
  // exchange's sends) needs from this rank.
  // The deadline starts at the first idle call (a sum whose peers are there never reads the
  // clock).
  struct ShmIdle final : detail::ShmExchange::Idle {
    ShmIdle(MpiCommunicator& c, const Pending& p) : comm(c), op(p.op), sequence(p.sequence) {}
    void operator()() override {
      int flag = 0;
      MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm.comm_, &flag, MPI_STATUS_IGNORE);
      if (!(comm.timeout() > 0)) return;
      const auto now = std::chrono::steady_clock::now();
      if (!started) {
        deadline = now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             std::chrono::duration<double>(comm.timeout()));
        started = true;
      } else if (now > deadline) {
        std::fprintf(stderr, "%s\n", comm.watchdog_message(op, sequence).c_str());
        std::fflush(stderr);
        abort_world(kWatchdogExitCode);
      }
    }
    MpiCommunicator& comm;
    const char* op;
    uint64_t sequence;
    bool started = false;
    std::chrono::steady_clock::time_point deadline;
  };

  bool exchanges(size_t bytes) const {
    return size_ > 1 && bytes * static_cast<size_t>(size_ - 1) <= kExchangeBytes;
  }
  static int pieces_of(int count, int per_piece) {
    return count < 0 ? 0 : (count + 1 + per_piece - 1) / per_piece;  // the count travels too
  }
  // Element 0 of a contribution: the sender's count, in the sum's own type.
  static void store_count(void* at, DType dtype, int count) {
    if (dtype == DType::F64)
      *static_cast<double*>(at) = count;
    else if (dtype == DType::I64)
      *static_cast<int64_t*>(at) = count;
    else
      *static_cast<float*>(at) = static_cast<float>(count);
  }
  static int load_count(const void* at, DType dtype) {
    double c = dtype == DType::F64   ? *static_cast<const double*>(at)
               : dtype == DType::I64 ? static_cast<double>(*static_cast<const int64_t*>(at))
                                     : *static_cast<const float*>(at);
    return c >= 0 && c < 2147483647.0 && c == static_cast<int>(c) ? static_cast<int>(c) : -1;
  }

  // The exchange's sum: contributions of ranks 0..P-1 added in that order into `mine`.
  // `others` holds ranks 0..P-1 without this one, in order, `stride` bytes apart: slot k is
  // rank k + (k >= rank_).
  template <class T>
  void add_in_rank_order(T* mine, const char* others, size_t stride, int n) const {
    auto other = [&](int r) {
      return reinterpret_cast<const T*>(others + (r - (r > rank_)) * stride);
    };
    for (int i = 0; i < n; ++i) {
      T acc = rank_ == 0 ? mine[i] : other(0)[i];
      for (int r = 1; r < size_; ++r) acc += r == rank_ ? mine[i] : other(r)[i];
      mine[i] = acc;
    }
  }

  // The quick wait (Communicator::note_quick_wait). A wait after long work finds every line
  // and page it touches cold (about a microsecond per page on a virtual machine); the lists
  // below (pending_, the exchange's records) are each elsewhere in memory. So a started
  // shared-memory sum is also noted in the communicator's quick table, and the exchange raises
  // done_words_[nth % kSlots], kept here in this object, to nth + 1 once the sum is in the
  // buffer without error (shm_exchange.h, "Completion words"). Communicator::wait finds it
  // there and returns without calling do_wait; the next call on this communicator (a start, a
  // blocking sum, a wait that is not quick; the destructor completes every pending sum anyway)
  // completes those sums as usual (they are done: nothing is waited, nothing thrown), which
  // recycles their records. The words are written by whichever thread adds the sum. Anything
  // else (an older note overwritten, a sum not yet done, an error) takes do_wait.
  alignas(64) std::atomic<uint64_t> done_words_[detail::ShmExchange::kSlots] = {};
  void settle_quick_waits() {
    uint64_t ids[kQuickWaits];
    const size_t n = take_quick_waits(ids);
    // Done, without error: each completes at once.
    for (size_t k = 0; k < n; ++k) complete_pending(ids[k], /*may_throw=*/false);
  }
  // Takes started sum `id` off pending_ (before completing it: a failed completion is not
  // retried) and completes it; an id not there was completed already.
  void complete_pending(uint64_t id, bool may_throw) {
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (pending_[i].id != id) continue;
      Pending p = std::move(pending_[i]);
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
      complete(p, may_throw);
      return;
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::vector<Pending> pending_;              // started, not yet waited, in start order
  uint64_t started_ = 0;                      // sums started so far (blocking ones too)
  std::unique_ptr<detail::ShmExchange> shm_;  // null: not all on one node, or TPNORM_SHM=0

  // Exchange sends still in flight after their sum was waited, with the copy they read.
  struct Retired {
    std::vector<MPI_Request> reqs;
    std::vector<double> send;
  };
  std::vector<Retired> retired_;
  // Moves an exchange's sends out of p (its wait then needs its receives only), and drops
  // the retired sends that have completed since.
  void retire_sends(Pending& p) {
    for (size_t i = 0; i < retired_.size();) {
      int done = 0;
      MPI_Testall(static_cast<int>(retired_[i].reqs.size()), retired_[i].reqs.data(), &done,
                  MPI_STATUSES_IGNORE);
      if (done) {
        retired_[i] = std::move(retired_.back());
        retired_.pop_back();
      } else {
        ++i;
      }
    }
    if (!p.exchange || p.send.empty()) return;
    Retired r;
    r.reqs.assign(p.reqs.begin() + p.receives, p.reqs.end());
    r.send = std::move(p.send);
    p.reqs.resize(static_cast<size_t>(p.receives));
    retired_.push_back(std::move(r));
  }
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm) {
  return std::make_unique<MpiCommunicator>(comm);
}

uint64_t mpi_shared_memory_sums(const Communicator& comm) {
  const auto* m = dynamic_cast<const MpiCommunicator*>(&comm);
  return m ? m->shared_memory_sums() : 0;
}

uint64_t mpi_background_sums(const Communicator& comm) {
  const auto* m = dynamic_cast<const MpiCommunicator*>(&comm);
  return m ? m->background_sums() : 0;
}

uint64_t mpi_quick_waits(const Communicator& comm) {
  const auto* m = dynamic_cast<const MpiCommunicator*>(&comm);
  return m ? m->quick_waits() : 0;
}

}  // namespace tpnorm
