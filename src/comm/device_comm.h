// device_comm.h — what the ops need from a device-memory communicator beyond all_reduce_sum,
// without CUDA types (packed_call.cpp includes it in CPU-only builds too; then nothing derives
// from it). Implemented in src/comm/cuda/.
//
// Invariants: all device work of a call is ordered on stream(); workspace memory is owned by
// the communicator, each call in flight holds its own region, and a released region is reused
// by a later call (stream order makes that safe without synchronisation).
#pragma once

#include <cstddef>
#include <string>

#include "tpnorm/communicator.h"

namespace tpnorm::detail {

/// The int64 poison (Stats::kExact headers): all-ones bytes would be -1, which cancels
/// another rank's +1 failure flag. 2^48 in every word (byte 6 of each little-endian word set to
/// 1, the rest zero) cannot: the summed flag of k >= 1 poisoned ranks and f failed ones is
/// k * 2^48 + f, never 0 and below 2^63 up to exact::kMaxRanks ranks; the summed count is past
/// 2^32, which the exact header check also rejects.
inline constexpr int kInt64PoisonByte = 6;
inline constexpr long long kInt64Poison = 1LL << (8 * kInt64PoisonByte);

class DeviceCommunicator : public Communicator {
 public:
  /// A region of device memory of at least `bytes`, 256-byte aligned, that no other call in
  /// flight holds, until release_workspace (a call's finish): calls started before others
  /// finish (tpnorm/split.h) each keep their own header, payload and scratch. Regions are
  /// reused, never freed while the communicator lives (captured graphs replay into them; see
  /// comm/cuda/workspace.h); throws tpnorm::Error if the pool must grow while the stream is
  /// being captured, or if the allocation fails.
  virtual void* acquire_workspace(size_t bytes) = 0;
  /// Returns a region acquire_workspace gave; the next call may take it (stream order).
  virtual void release_workspace(void* region) = 0;
  /// The device word the apply kernels set when a call's header says a rank failed or the
  /// ranks disagree (an int, 0 = fine).
  virtual int* error_word() = 0;
  /// Host-side sum of `n` doubles over the ranks, for the strict pre-check and for the
  /// diagnosis of a failed call; never used by the steady-state device path.
  virtual void control_all_reduce_sum(double* buf, size_t n) = 0;
  /// Enqueues on stream() a poisoned header over [base, base + bytes), which every rank's
  /// apply kernels reject whatever the other ranks add: all-ones bytes (NaN) in the float
  /// wire types; with `int64` (Stats::kExact) kInt64Poison in every word. For a call header
  /// whose write could not be launched: the rank still joins the collective, and the call
  /// fails everywhere.
  virtual void poison(void* base, size_t bytes, bool int64) = 0;
  /// True while stream() is being captured into a CUDA graph.
  virtual bool capturing() const = 0;
  /// Whether control_all_reduce_sum works while stream() is being captured (a host transport
  /// does; one that goes through the stream cannot): captured calls are then checked on the
  /// host, so that a failure on one rank is every rank's error (run_op).
  virtual bool control_while_capturing() const { return true; }
  /// The CUDA device ordinal of this communicator's buffers and stream.
  virtual int device_index() const = 0;
  /// Ends the job with `message`, the watchdog's way (ncclCommAbort or MPI_Abort, exit status
  /// 124): for a rank that cannot join its call's collective, which its peers would otherwise
  /// wait for forever.
  [[noreturn]] virtual void abort_job(const std::string& message) = 0;
};

}  // namespace tpnorm::detail
