// tpnorm/cuda.h — device-memory communicators (CUDA / NCCL). The only public header with
// CUDA or NCCL types; tpnorm/cuda_mpi.h adds the ones made from an MPI_Comm.
//
// With a device communicator every op of tpnorm/norm.h takes views on Device::cuda(i) and runs
// on the communicator's stream: partial kernel -> ONE collective on the stream -> apply kernel.
// A call enqueues work and returns; it never synchronises the host, allocates, or calls MPI,
// except in three documented places, all outside the steady state:
//   * each call in flight holds its own region of the communicator's device workspace pool
//     (its header, statistics and scratch) from its start to its finish, so calls started
//     before others finish (tpnorm/split.h) never share one; a call that finds no free region
//     large enough allocates one (cudaMalloc, no synchronisation). Regions are reused, never
//     freed while the communicator lives. A call captured in a CUDA graph keeps its region for
//     captured calls only (the graph replays into it); a capture never allocates, so run the
//     captured calls once before capturing them (or cuda_reserve_workspace), else the capture
//     throws kInvalidArgument;
//   * a SyncBatchNorm training forward that advances num_batches_tracked checks its call on
//     the host first (the counter and the cumulative momentum advance only for an accepted
//     call) and cannot be captured;
//   * the first Communicator::set_strict_calls() calls (16 by default) check every rank's
//     arguments and call fingerprint on the HOST (MPI for communicators made from an MPI_Comm,
//     else a small NCCL all-reduce and a wait on the stream) before any device work, so a
//     bad argument on one rank throws the same tpnorm::Error on every rank. set_strict_calls(0)
//     turns this off.
// After the strict calls, each rank still checks its own arguments on the host (a failing rank
// joins the collective with its error flag, then throws; so does a rank whose partial kernels
// failed to launch), and the error flag, the global element count and the call fingerprint
// travel in the header of the call's one collective; the apply kernels check them ON DEVICE:
// a failed or disagreeing call leaves every output untouched and sets the communicator's
// device error word, which cuda_check_errors() reports.
//
// Watchdog (Communicator::set_timeout, TPNORM_TIMEOUT): the NCCL communicator records an event
// after each collective it enqueues and a host thread checks, every millisecond, that it
// completes within timeout() and that ncclCommGetAsyncError reports nothing; otherwise it
// prints the watchdog's message, calls ncclCommAbort and exits the process with status 124
// (mpirun then ends the job). Every host-side wait on a device collective (the strict calls'
// check, cuda_check_errors) is bounded by the same timeout. Collectives replayed from a
// captured graph are not watched.
// A rank that cannot join a collective at all (its workspace could not grow after the strict
// calls, ncclAllReduce failed) ends the job the same way at once, rather than leaving its
// peers waiting. A borrowed non-blocking NCCL communicator's ncclInProgress is waited out by
// polling ncclCommGetAsyncError (within timeout()).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "tpnorm/communicator.h"

#ifdef TPNORM_WITH_NCCL
#include <nccl.h>
#endif

namespace tpnorm {

/// One rank on one GPU: all_reduce_sum is the identity. Borrows `stream` (nullptr: the legacy
/// default stream) on CUDA device `device`.
std::unique_ptr<Communicator> make_cuda_single_communicator(cudaStream_t stream, int device);

#ifdef TPNORM_WITH_NCCL
/// Borrows a caller's NCCL communicator and stream: tpnorm never destroys either. Rank, size
/// and device come from `comm`; `stream` must belong to that device (else tpnorm::Error
/// kInvalidArgument) or be nullptr. `comm` may be non-blocking (ncclConfig_t::blocking = 0).
/// The strict pre-check uses a small NCCL all-reduce plus a wait on `stream` (there is no MPI
/// to use). On a watchdog abort tpnorm calls ncclCommAbort on `comm` before exiting.
std::unique_ptr<Communicator> make_nccl_communicator(ncclComm_t comm, cudaStream_t stream);
#endif

/// Synchronises the communicator's stream and throws tpnorm::Error(kMismatch) if a device call
/// since the last check found a failed or disagreeing rank (then its outputs were not written),
/// clearing the flag. Not for use inside graph capture. No-op for host communicators.
void cuda_check_errors(Communicator& comm);

/// Makes the communicator's device workspace pool hold a free region of at least `bytes` now,
/// so that a later call (or a call captured into a graph) need not allocate. Each call in
/// flight holds its own region from start to finish; a call captured into a graph keeps its
/// region for captured calls only (the graph replays into it). A capture that needs a region no
/// earlier call left free throws kInvalidArgument: run the captured sequence once first, or
/// reserve. Optional: eager calls grow the pool themselves. Throws (kInvalidArgument) while the
/// stream is being captured.
void cuda_reserve_workspace(Communicator& comm, size_t bytes);

}  // namespace tpnorm
