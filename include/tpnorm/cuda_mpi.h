// tpnorm/cuda_mpi.h — device communicators made from an MPI_Comm (CUDA + MPI).
#pragma once

#include <mpi.h>

#include "tpnorm/cuda.h"

namespace tpnorm {

#ifdef TPNORM_WITH_NCCL
/// Collective over `comm`: picks this rank's GPU (its rank among the ranks on its node, from
/// MPI_Comm_split_type, modulo the visible GPUs) and makes it current, makes an NCCL
/// communicator (unique id from rank 0 by MPI_Bcast, MPI_Barrier, ncclCommInitRank) that the
/// returned object owns and destroys, and borrows `stream` (created by the caller on that GPU
/// after this call, or nullptr for the default stream). The strict pre-check goes over MPI.
/// NCCL refuses two ranks on one GPU: use make_mpi_staged_cuda_communicator then.
std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, cudaStream_t stream);
#endif

/// Device buffers reduced through host memory over MPI: copy to pinned host memory,
/// synchronise the stream, MPI_Allreduce, copy back. Works with any number of ranks per GPU
/// (tests, debugging); NOT graph-capturable and slower than NCCL. Borrows `stream` on `device`.
std::unique_ptr<Communicator> make_mpi_staged_cuda_communicator(MPI_Comm comm,
                                                                cudaStream_t stream, int device);

/// The GPU make_nccl_communicator(MPI_Comm, ...) would pick for this rank (collective).
int local_cuda_device(MPI_Comm comm);

}  // namespace tpnorm
