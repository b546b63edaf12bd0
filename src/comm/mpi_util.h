// mpi_util.h — what the host MPI communicator (comm/mpi.cpp) and the device communicators'
// MPI side (comm/cuda/cuda_comm.cpp) share: the MPI datatype of a buffer's dtype and the
// duplicate of the caller's communicator each of them works on.
#pragma once

#include <mpi.h>

#include <string>

#include "comm/mpi_check.h"
#include "common/check.h"
#include "tpnorm/error.h"
#include "tpnorm/tensor.h"

namespace tpnorm::detail {

/// The MPI datatype of an all_reduce_sum buffer: fp64, fp32 or int64 (Stats::kExact's limbs).
inline MPI_Datatype mpi_type(DType t) {
  if (t == DType::F64) return MPI_DOUBLE;
  if (t == DType::F32) return MPI_FLOAT;
  if (t == DType::I64) return MPI_INT64_T;
  throw Error(
      ErrorCode::kInvalidArgument,
      std::string("tpnorm: MPI all_reduce_sum supports fp32, fp64 and int64 buffers, not ") +
          dtype_name(t));
}

/// *comm = a duplicate of `parent` (so that tpnorm's traffic never matches the caller's
/// messages) whose errors come back as return codes (and become tpnorm::Error) instead of
/// aborting; *rank and *size are this process's place in it. The caller frees *comm.
inline void dup_comm(MPI_Comm parent, MPI_Comm* comm, int* rank, int* size) {
  TPNORM_CHECK(MPI, MPI_Comm_dup(parent, comm));
  TPNORM_CHECK(MPI, MPI_Comm_set_errhandler(*comm, MPI_ERRORS_RETURN));
  TPNORM_CHECK(MPI, MPI_Comm_rank(*comm, rank));
  TPNORM_CHECK(MPI, MPI_Comm_size(*comm, size));
}

}  // namespace tpnorm::detail
