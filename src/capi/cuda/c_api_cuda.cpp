// c_api_cuda.cpp — the device communicators of the C API (tpnorm/c_api_cuda.h), over
// tpnorm/cuda.h and tpnorm/cuda_mpi.h. Built with the CUDA backend only.
#include "tpnorm/c_api_cuda.h"

#include <mpi.h>

#include "capi/c_api_common.h"
#include "tpnorm/cuda_mpi.h"

using tpnorm::capi::create;
using tpnorm::capi::get;
using tpnorm::capi::guarded;

extern "C" {

tpnorm_status_t tpnorm_comm_create_cuda_single(cudaStream_t stream, int device,
                                               tpnorm_comm_t* out) {
  return create(out, [&] { return tpnorm::make_cuda_single_communicator(stream, device); });
}

tpnorm_status_t tpnorm_comm_create_mpi_staged_cuda_fortran(int fortran_comm, cudaStream_t stream,
                                                           int device, tpnorm_comm_t* out) {
  return create(out, [&] {
    return tpnorm::make_mpi_staged_cuda_communicator(MPI_Comm_f2c(fortran_comm), stream, device);
  });
}

tpnorm_status_t tpnorm_comm_create_nccl_fortran(int fortran_comm, cudaStream_t stream, int device,
                                                tpnorm_comm_t* out) {
  return create(out, [&]() -> std::unique_ptr<tpnorm::Communicator> {
#ifdef TPNORM_WITH_NCCL
    const MPI_Comm comm = MPI_Comm_f2c(fortran_comm);
    return device < 0 ? tpnorm::make_nccl_communicator(comm, stream)
                      : tpnorm::make_nccl_communicator(comm, stream, device);
#else
    (void)fortran_comm, (void)stream, (void)device;
    throw tpnorm::Error(tpnorm::ErrorCode::kCommunication,
                        "tpnorm: this build has no NCCL (tpnorm_comm_create_nccl)");
#endif
  });
}

tpnorm_status_t tpnorm_cuda_check_errors(tpnorm_comm_t comm) {
  return guarded([&] { tpnorm::cuda_check_errors(*get(comm)); });
}

}  // extern "C"
