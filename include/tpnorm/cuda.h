// tpnorm/cuda.h — device-memory communicators (CUDA / NCCL). The only public header with
// CUDA or NCCL types; tpnorm/cuda_mpi.h adds the ones made from an MPI_Comm.
//
// With a device communicator every op of tpnorm/norm.h takes views on Device::cuda(i) and runs
// on the communicator's stream: partial kernel -> ONE collective on the stream -> apply kernel.
// A call enqueues work and returns; it never synchronises the host, allocates, or calls MPI,
// except in two documented places, both outside the steady state:
//   * the first call that needs more workspace than any earlier call grows the communicator's
//     device workspace (cudaMalloc); run a call once before capturing it in a CUDA graph;
//   * the first Communicator::set_strict_calls() calls (16 by default) check every rank's
//     arguments and call fingerprint on the HOST (MPI for communicators made from an MPI_Comm,
//     else a small NCCL all-reduce and a stream synchronisation) before any device work, so a
//     bad argument on one rank throws the same tpnorm::Error on every rank. set_strict_calls(0)
//     turns this off.
// After the strict calls, each rank still checks its own arguments on the host (a failing rank
// throws after joining the collective), and the error flag, the global element count and the
// call fingerprint travel in the header of the call's one collective; the apply kernels check
// them ON DEVICE: a failed or disagreeing call leaves every output untouched and sets the
// communicator's device error word, which cuda_check_errors() reports.
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
/// and device come from `comm`. The strict pre-check uses a small NCCL all-reduce plus a
/// synchronisation of `stream` (there is no MPI to use).
std::unique_ptr<Communicator> make_nccl_communicator(ncclComm_t comm, cudaStream_t stream);
#endif

/// Synchronises the communicator's stream and throws tpnorm::Error(kMismatch) if a device call
/// since the last check found a failed or disagreeing rank (then its outputs were not written),
/// clearing the flag. Not for use inside graph capture. No-op for host communicators.
void cuda_check_errors(Communicator& comm);

/// Grows the communicator's device workspace to at least `bytes` now, so later calls (and
/// graph captures) never allocate. Optional: calls grow it themselves outside capture.
void cuda_reserve_workspace(Communicator& comm, size_t bytes);

}  // namespace tpnorm
