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
// every rank (the usual rule for collectives).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tpnorm/tensor.h"

namespace tpnorm {

/// Traffic counters, per communicator, updated by every all_reduce_sum.
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

  /// The stream device work is ordered on (a cudaStream_t as void*); nullptr for host backends.
  virtual void* stream() const { return nullptr; }

  const CommCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

  /// Per-communicator call sequence number, part of every call's cross-rank fingerprint.
  uint64_t next_sequence() { return ++sequence_; }
  uint64_t sequence() const { return sequence_; }

  /// Strict agreement: the first `n` calls on this communicator (all when n < 0) check the
  /// fingerprint and error flags in a small collective BEFORE the payload collective, so that
  /// ranks that disagree on sizes never enter a payload collective of different lengths.
  /// Later calls fold the fingerprint into the payload collective. Default: the environment
  /// variable TPNORM_STRICT_CALLS, else 16.
  void set_strict_calls(int64_t n) { strict_calls_ = n; }
  bool strict_now() const { return strict_calls_ < 0 || static_cast<int64_t>(sequence_) <= strict_calls_; }

  /// Watchdog: a collective still unfinished after `seconds` (a rank died or stopped calling)
  /// ends the WHOLE job (MPI_Abort / ncclCommAbort) with a message on stderr naming the op,
  /// this rank and the call sequence number, instead of hanging forever. <= 0 disables it.
  /// Default: the environment variable TPNORM_TIMEOUT (seconds), else 300.
  void set_timeout(double seconds) { timeout_s_ = seconds; }
  double timeout() const { return timeout_s_; }
  /// The public call in progress (a string literal), named by the watchdog; set by the ops.
  void set_current_op(const char* op) { current_op_ = op; }

 protected:
  virtual void do_all_reduce_sum(void* buf, size_t count, DType dtype) = 0;
  /// The watchdog's one-line message for the collective now overdue.
  std::string watchdog_message() const;

 private:
  CommCounters counters_;
  uint64_t sequence_ = 0;
  int64_t strict_calls_ = default_strict_calls();
  double timeout_s_ = default_timeout();
  const char* current_op_ = nullptr;
  static int64_t default_strict_calls();
  static double default_timeout();
};

/// A communicator of one rank: all_reduce_sum is the identity (and still counted).
/// [in] device: where its buffers live. Device ops need a stream and a workspace: for one
/// GPU use make_cuda_single_communicator (tpnorm/cuda.h); a CUDA-device communicator from here
/// makes every op fail with a message that says so.
std::unique_ptr<Communicator> make_single_communicator(Device device = Device::cpu());

}  // namespace tpnorm
