// communicators.h — tpnorm communicators made from what a PyTorch job already has.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>

#include "tpnorm/communicator.h"

namespace tpnorm::python {

/// Over an MPI communicator given by its Fortran handle (mpi4py: comm.py2f()), converted with
/// MPI_Comm_f2c into tpnorm's MPI path (which works on a duplicate).
std::shared_ptr<Communicator> mpi_communicator(int64_t fortran_handle);

/// A host communicator whose all_reduce_sum calls `all_reduce(capsule)` in Python: the capsule
/// is a DLPack view of the packed buffer itself (1-D, float32, float64 or int64, CPU), so the
/// function's torch.utils.dlpack.from_dlpack(capsule) tensor shares its memory and the
/// process group sums it in place with no copy. The op runs without the GIL; the callback
/// takes it for the duration of the Python call only. An exception in the callback becomes
/// tpnorm.Error (code kCommunication).
std::shared_ptr<Communicator> callback_communicator(int rank, int size,
                                                    pybind11::function all_reduce);

/// Whether this build has tpnorm's NCCL communicator.
bool has_nccl();
/// A fresh ncclUniqueId as bytes (for the group's rank 0 to broadcast).
pybind11::bytes nccl_unique_id();
/// An NCCL communicator of `size` ranks made from the broadcast id (ncclCommInitRank) on CUDA
/// device `device`, running on `stream` (a cudaStream_t as an integer, e.g.
/// torch.cuda.current_stream().cuda_stream). The ncclComm_t is owned by the result.
std::shared_ptr<Communicator> nccl_communicator(pybind11::bytes unique_id, int rank, int size,
                                                int device, uintptr_t stream);

}  // namespace tpnorm::python
