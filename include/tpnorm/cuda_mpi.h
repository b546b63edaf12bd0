// tpnorm/cuda_mpi.h — device communicators made from an MPI_Comm (CUDA + MPI).
//
// Which GPU a rank uses. The convention is one rank per GPU, the GPU chosen by the rank's
// NODE-LOCAL rank: the rank's index among the ranks of `comm` on its node, found with
// MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED). For comm = MPI_COMM_WORLD this is the
// number launchers export as OMPI_COMM_WORLD_LOCAL_RANK (Open MPI's mpirun) or SLURM_LOCALID
// (srun); it is never the global rank modulo the GPU count, which pairs ranks of different
// nodes with wrong GPUs as soon as a node holds fewer ranks than GPUs. A launcher that gives
// each rank exactly one visible GPU (CUDA_VISIBLE_DEVICES per rank) makes that GPU device 0.
// For a sub-communicator (e.g. a tensor-parallel group) whose node-local index is not the GPU
// index, pass the device explicitly (the three-argument overload below).
#pragma once

#include <mpi.h>

#include "tpnorm/cuda.h"

namespace tpnorm {

#ifdef TPNORM_WITH_NCCL
/// Collective over `comm`: makes an NCCL communicator on CUDA device `device` (unique id from
/// rank 0 by MPI_Bcast, ncclCommInitRank) that the returned object owns and destroys, and
/// borrows `stream`, which must belong to `device` (create it after cudaSetDevice(device); a
/// stream of another device is an error) or be nullptr for the default stream. Makes
/// `device` current. Every local failure (no such device, a stream on another device, no NCCL
/// id, a failed ncclCommInitRank) is agreed on by MPI before the next step waits for peers, so
/// it throws the same tpnorm::Error on every rank instead of leaving the others waiting; the
/// wait inside ncclCommInitRank is bounded by Communicator::default_timeout() (TPNORM_TIMEOUT).
/// The communicator is non-blocking (ncclConfig_t::blocking = 0). The strict pre-check goes
/// over MPI. NCCL refuses two ranks on one GPU: use
/// make_mpi_staged_cuda_communicator then.
std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, cudaStream_t stream,
                                                     int device);

/// As above on this rank's GPU (see the header comment): device 0 when exactly one GPU is
/// visible, else the node-local rank, which must be below the visible GPU count (an error on
/// every rank otherwise).
std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, cudaStream_t stream);
#endif

/// Device buffers reduced through host memory over MPI: copy to pinned host memory, wait for
/// the stream, MPI all-reduce, copy back. Works with any number of ranks per GPU (tests,
/// debugging); NOT graph-capturable and slower than NCCL. Borrows `stream` on `device`.
/// Watchdog: the wait for the stream and the MPI all-reduce (MPI_Iallreduce polled with
/// MPI_Test) are polled against Communicator::timeout(); an overdue one ends the job with
/// MPI_Abort (exit status 124) and the watchdog's message.
std::unique_ptr<Communicator> make_mpi_staged_cuda_communicator(MPI_Comm comm, cudaStream_t stream,
                                                                int device);

/// A GPU for this rank when several ranks may share the visible GPUs (the MPI-staged
/// communicator's tests): the node-local rank modulo the visible GPU count (collective).
int local_cuda_device(MPI_Comm comm);

}  // namespace tpnorm
