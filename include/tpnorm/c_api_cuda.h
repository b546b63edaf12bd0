/* tpnorm/c_api_cuda.h — device communicators for the C API (CUDA; MPI_Comm overloads when
 * mpi.h is included first). With a communicator made here, every pointer passed to the ops of
 * tpnorm/c_api.h is device memory on the communicator's GPU, and the calls run on its stream
 * (see tpnorm/cuda.h for what is checked where: a bad argument is the same error on every
 * rank; after the strict calls a disagreement is found on device and reported by
 * tpnorm_cuda_check_errors). The stream is borrowed: tpnorm never destroys it. */
#ifndef TPNORM_C_API_CUDA_H_
#define TPNORM_C_API_CUDA_H_

#include <cuda_runtime_api.h>

#include "tpnorm/c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One rank on CUDA device `device`, on `stream` (NULL: the default stream). */
tpnorm_status_t tpnorm_comm_create_cuda_single(cudaStream_t stream, int device, tpnorm_comm_t* out);
/* Collective over MPI_Comm_f2c(fortran_comm): device buffers reduced through host memory over
 * MPI (any number of ranks per GPU; for tests, not speed). */
tpnorm_status_t tpnorm_comm_create_mpi_staged_cuda_fortran(int fortran_comm, cudaStream_t stream,
                                                           int device, tpnorm_comm_t* out);
/* Collective over MPI_Comm_f2c(fortran_comm): an NCCL communicator on CUDA device `device`, or
 * on this rank's GPU (the node-local rank; see tpnorm/cuda_mpi.h) when device < 0. Returns
 * TPNORM_COMMUNICATION (on every rank) when the build has no NCCL. */
tpnorm_status_t tpnorm_comm_create_nccl_fortran(int fortran_comm, cudaStream_t stream, int device,
                                                tpnorm_comm_t* out);
/* Waits for the communicator's stream; TPNORM_MISMATCH if a device call since the last check
 * found a failed or disagreeing rank (its outputs were not written). Success for host ones. */
tpnorm_status_t tpnorm_cuda_check_errors(tpnorm_comm_t comm);

#ifdef __cplusplus
} /* extern "C" */
#endif

#ifdef MPI_VERSION
static inline tpnorm_status_t tpnorm_comm_create_mpi_staged_cuda(MPI_Comm comm, cudaStream_t stream,
                                                                 int device, tpnorm_comm_t* out) {
  return tpnorm_comm_create_mpi_staged_cuda_fortran((int)MPI_Comm_c2f(comm), stream, device, out);
}
static inline tpnorm_status_t tpnorm_comm_create_nccl(MPI_Comm comm, cudaStream_t stream,
                                                      int device, tpnorm_comm_t* out) {
  return tpnorm_comm_create_nccl_fortran((int)MPI_Comm_c2f(comm), stream, device, out);
}
#endif

#endif /* TPNORM_C_API_CUDA_H_ */
