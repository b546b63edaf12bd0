// tpnorm/communicator.h — the only thing tpnorm's ops know about communication.
//
// A Communicator is a group of ranks that can sum a packed buffer in place. It knows nothing of
// norms; the ops pack every statistic of one call into one buffer and make ONE all_reduce_sum.
// Implementations: single-process (this header), MPI over host buffers (tpnorm/mpi.h), NCCL and
// MPI-staged device buffers (tpnorm/cuda.h). Communicators created from a caller's handle
// borrow it: MPI communicators work on a duplicate (MPI_Comm_dup) that they free; NCCL ones
// never destroy the caller's ncclComm_t or stream.
//
// Not thread-safe: one thread issues calls on a communicator at a time, in the same order on
// every rank (the usual rule for collectives). Non-blocking sums (start_all_reduce_sum) follow
// the same rule: every rank starts them in the same order; they may be waited in any order.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "tpnorm/tensor.h"

namespace tpnorm {

/// Traffic counters, per communicator, updated by every all_reduce_sum and every
/// start_all_reduce_sum (when it is started, so a started sum counts once whether or not it
/// has been waited yet).
struct CommCounters {
  uint64_t calls = 0;       ///< collectives issued
  uint64_t bytes_sent = 0;  ///< payload bytes this rank contributed (count * dtype size)
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Where buffers passed to all_reduce_sum must live (CPU for MPI / single-process).
  virtual Device device() const = 0;

  /// In-place sum over all ranks of `count` elements of `dtype` at `buf`.
  /// [in,out] buf: `count` elements on device(); every rank passes the same count and dtype.
  /// Throws tpnorm::Error(kCommunication) if the transport fails.
  void all_reduce_sum(void* buf, size_t count, DType dtype);

  /// A non-blocking sum in flight: returned by start_all_reduce_sum, completed by wait().
  /// A ticket (id 0 = nothing to wait for) that can be moved but not copied: one sum has one
  /// ticket, so it cannot be waited twice through two copies (which would count it out of
  /// in_flight() twice). A moved-from ticket has id 0.
  struct Request {
    uint64_t id = 0;
    Request() = default;
    explicit Request(uint64_t i) : id(i) {}
    Request(const Request&) = delete;
    Request& operator=(const Request&) = delete;
    Request(Request&& o) noexcept : id(std::exchange(o.id, 0)) {}
    Request& operator=(Request&& o) noexcept {
      id = std::exchange(o.id, 0);  // a self-move keeps the id: exchange returns it first
      return *this;
    }
  };
  /// Starts the in-place sum of all_reduce_sum and returns without waiting for it. `buf` must
  /// stay valid and untouched until wait() returns. Several sums may be in flight; every rank
  /// starts them in the same order (they are collectives) and may wait them in any order.
  /// Counted in counters() now. Backends without a non-blocking path sum here and wait() does
  /// nothing (the default); the MPI communicator uses MPI_Iallreduce, and its wait() is covered
  /// by the watchdog (set_timeout) like a blocking sum.
  /// Throws tpnorm::Error(kCommunication) if the transport fails to start the sum.
  Request start_all_reduce_sum(void* buf, size_t count, DType dtype);
  /// Waits for a started sum; afterwards `buf` holds the sum and `r.id` is 0. Waiting a request
  /// twice (id 0) does nothing. Throws tpnorm::Error(kCommunication) if the transport fails.
  void wait(Request& r);
  /// Started sums not yet waited.
  size_t in_flight() const { return in_flight_; }
  /// Says that the sums started so far will be waited later, after other work: a backend with
  /// a progress engine may complete them meanwhile, so that wait() finds them done. The
  /// split-phase calls (tpnorm/split.h) say it when their start returns; blocking calls, whose
  /// wait follows at once, do not. The default does nothing (the MPI communicator hands its
  /// shared-memory sums to a progress thread; docs/split-phase.md). A wrapper around
  /// another communicator forwards it.
  void progress_in_background() { do_progress_in_background(); }

  /// Sums of at most this many bytes per rank are size-checked: if the ranks pass different
  /// counts, wait() (or all_reduce_sum) throws tpnorm::Error(kMismatch) on EVERY rank, and the
  /// communicator stays usable. Larger sums, and every sum of a backend that returns 0 (the
  /// default), need equal counts on every rank (MPI would abort or hang). The ops use it to
  /// check their agreement header inside the one sum of a small call (see set_strict_calls).
  virtual size_t size_checked_sum_bytes() const { return 0; }

  /// The stream device work is ordered on (a cudaStream_t as void*); nullptr for host backends.
  virtual void* stream() const { return nullptr; }

  const CommCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

  /// Per-communicator call sequence number, part of every call's cross-rank fingerprint.
  uint64_t next_sequence() { return ++sequence_; }
  uint64_t sequence() const { return sequence_; }

  /// Strict agreement: the first `n` calls on this communicator (all when n < 0) check the
  /// fingerprint and error flags in a small collective BEFORE the payload collective, so that
  /// ranks that disagree on sizes never enter a payload collective of different lengths —
  /// except calls whose header + payload fit size_checked_sum_bytes(): those check the
  /// header inside their one (size-checked) sum. Later calls fold the fingerprint into the
  /// payload collective. Default: the environment
  /// variable TPNORM_STRICT_CALLS, else -1 (every call) on MPI communicators, whose check is
  /// non-blocking and runs under the call's partial phase, and 16 on the others (single-process,
  /// device communicators, whose check is a blocking host collective).
  void set_strict_calls(int64_t n) { strict_calls_ = n; }
  bool strict_now() const {
    return strict_calls_ < 0 || static_cast<int64_t>(sequence_) <= strict_calls_;
  }

  /// Watchdog: a collective still unfinished after `seconds` (a rank died or stopped calling)
  /// ends the WHOLE job (MPI_Abort / ncclCommAbort) with a message on stderr naming the op,
  /// this rank and the call sequence number, instead of hanging forever. <= 0 disables it.
  /// Default: the environment variable TPNORM_TIMEOUT (seconds), else 300.
  void set_timeout(double seconds) { timeout_s_ = seconds; }
  double timeout() const { return timeout_s_; }
  /// The watchdog's default timeout: TPNORM_TIMEOUT, else 300 (also the bound of the
  /// factories' waits for their peers, e.g. ncclCommInitRank).
  static double default_timeout();
  /// The public call in progress (a string literal), named by the watchdog; set by the ops.
  void set_current_op(const char* op) { current_op_ = op; }

  /// Ends the whole job with `message` on stderr, for a rank that can no longer join a
  /// collective its peers are in (MPI: MPI_Abort; the default: std::abort of this process).
  [[noreturn]] virtual void abort_job(const std::string& message);

  /// A started call (tpnorm/split.h) destroyed without finish(): its collective was completed
  /// so that no peer hangs, its outputs were not written, and the NEXT call on this
  /// communicator fails on every rank with `what` (set by the ops; read once by that call).
  void note_abandoned_call(const std::string& what) {
    if (abandoned_.empty()) abandoned_ = what;
  }
  std::string take_abandoned_call() {
    std::string s;
    s.swap(abandoned_);
    return s;
  }

 protected:
  virtual void do_all_reduce_sum(void* buf, size_t count, DType dtype) = 0;
  /// The non-blocking pair behind start_all_reduce_sum / wait, for backends that have one.
  /// `id` (> 0, increasing) names the sum; the default sums at start and waits for nothing,
  /// which is right for any backend whose do_all_reduce_sum is already asynchronous (device
  /// communicators enqueue on their stream) or blocking.
  virtual void do_start_all_reduce_sum(uint64_t id, void* buf, size_t count, DType dtype) {
    (void)id;
    do_all_reduce_sum(buf, count, dtype);
  }
  virtual void do_wait(uint64_t id) { (void)id; }
  virtual void do_progress_in_background() {}
  /// A backend's default for set_strict_calls; the environment variable TPNORM_STRICT_CALLS,
  /// when set, wins over it. Call from the derived constructor.
  void set_default_strict_calls(int64_t n) {
    if (!strict_calls_from_env()) strict_calls_ = n;
  }
  /// The watchdog's one-line message for the collective now overdue.
  std::string watchdog_message() const;
  /// The same for a started sum that was begun by `op` at call `sequence`.
  std::string watchdog_message(const char* op, uint64_t sequence) const;
  /// The op name and call sequence at the time of the call (for requests that outlive it).
  const char* current_op() const { return current_op_; }

  /// The quick wait, for backends whose started sums may be complete before their wait (the
  /// MPI communicator's progress thread): `word` reaches `value` (a release store) once
  /// started sum `id` is in the caller's buffer without error, and stays below `value` until
  /// then. wait() loads it first (acquire) and, when it is there, returns without do_wait: a
  /// wait after long work finds its code and data cold (about a microsecond per page on a
  /// virtual machine), and this object is what it reaches anyway. The ids so waited are handed
  /// to the backend by take_quick_waits() (at its next call; it completes their records then).
  /// A wait whose note a later id took, or that finds kQuickWaits quick waits not yet taken,
  /// goes to do_wait as before.
  static constexpr size_t kQuickWaits = 16;
  void note_quick_wait(uint64_t id, const std::atomic<uint64_t>* word, uint64_t value) {
    quick_[id % kQuickWaits] = {id, word, value};
  }
  /// Copies the ids waited the quick way since the last take into `ids` (room for
  /// kQuickWaits) and returns how many.
  size_t take_quick_waits(uint64_t* ids);
  /// Waits that took the quick path so far.
  uint64_t quick_waits() const { return quick_waits_; }

 private:
  CommCounters counters_;
  uint64_t sequence_ = 0;
  int64_t strict_calls_ = default_strict_calls();
  double timeout_s_ = default_timeout();
  const char* current_op_ = nullptr;
  std::string abandoned_;
  uint64_t next_request_ = 0;
  size_t in_flight_ = 0;
  // The quick wait (see note_quick_wait): entries by id % kQuickWaits, and the ids waited.
  struct QuickWait {
    uint64_t id = 0;  // 0: none
    const std::atomic<uint64_t>* word = nullptr;
    uint64_t value = 0;
  };
  QuickWait quick_[kQuickWaits];
  uint64_t quick_taken_[kQuickWaits] = {};
  size_t quick_count_ = 0;
  uint64_t quick_waits_ = 0;
  static int64_t default_strict_calls();
  static bool strict_calls_from_env();
};

/// A communicator of one rank: all_reduce_sum is the identity (and still counted).
/// [in] device: where its buffers live. Device ops need a stream and a workspace: for one
/// GPU use make_cuda_single_communicator (tpnorm/cuda.h); a CUDA-device communicator from here
/// makes every op fail with a message that says so.
std::unique_ptr<Communicator> make_single_communicator(Device device = Device::cpu());

/// Where this rank's slice of a sharded dimension of `total` elements starts when the ranks
/// hold consecutive slices in rank order: the sum of the lower ranks' `count`s (rank 0: 0).
/// For ops that take a slice's offset (tpnorm/group_norm.h, tpnorm/rms_norm_gated.h) when each
/// rank knows only its own size: call it once per layout (e.g. when a layer is built), not per
/// call. Collective over `comm`: one all_reduce_sum of 2P float64 values (on a device
/// communicator, its host control sum). Throws the same tpnorm::Error (kInvalidArgument) on
/// every rank when a count is negative, the ranks pass different totals, or the counts do not
/// add up to `total`.
int64_t slice_offset(Communicator& comm, int64_t count, int64_t total);

}  // namespace tpnorm
