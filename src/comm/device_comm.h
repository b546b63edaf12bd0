// device_comm.h — what the ops need from a device-memory communicator beyond all_reduce_sum,
// without CUDA types (packed_call.cpp includes it in CPU-only builds too; then nothing derives
// from it). Implemented in src/comm/cuda/.
//
// Invariants: all device work of a call is ordered on stream(); workspace() memory is owned by
// the communicator and reused by the next call (calls on one communicator are stream-ordered,
// so reuse is safe without synchronisation).
#pragma once

#include <cstddef>
#include <string>

#include "tpnorm/communicator.h"

namespace tpnorm::detail {

class DeviceCommunicator : public Communicator {
 public:
  /// Device memory of at least `bytes`, 256-byte aligned. Grows only when a call needs more
  /// than any earlier one, keeping the old block alive until the communicator is destroyed
  /// (captured graphs replay into it; see comm/cuda/workspace.h); throws tpnorm::Error if it
  /// must grow while the stream is being captured, or if the allocation fails.
  virtual void* workspace(size_t bytes) = 0;
  /// The device word the apply kernels set when a call's header says a rank failed or the
  /// ranks disagree (an int, 0 = fine).
  virtual int* error_word() = 0;
  /// Host-side sum of `n` doubles over the ranks, for the strict pre-check and for the
  /// diagnosis of a failed call; never used by the steady-state device path.
  virtual void control_all_reduce_sum(double* buf, size_t n) = 0;
  /// Enqueues on stream() all-ones bytes over [base, base + bytes): NaN in either wire type,
  /// which every rank's apply kernels reject. For a call header whose write could not be
  /// launched: the rank still joins the collective, and the call fails everywhere.
  virtual void poison(void* base, size_t bytes) = 0;
  /// The CUDA device ordinal of this communicator's buffers and stream.
  virtual int device_index() const = 0;
  /// Ends the job with `message`, the watchdog's way (ncclCommAbort or MPI_Abort, exit status
  /// 124): for a rank that cannot join its call's collective, which its peers would otherwise
  /// wait for forever.
  [[noreturn]] virtual void abort_job(const std::string& message) = 0;
};

}  // namespace tpnorm::detail
