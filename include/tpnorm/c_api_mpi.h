/* tpnorm/c_api_mpi.h — the MPI_Comm overload of the C API, for callers that include mpi.h. */
#ifndef TPNORM_C_API_MPI_H_
#define TPNORM_C_API_MPI_H_

#include <mpi.h>

#include "tpnorm/c_api.h"

/* As tpnorm_comm_create_mpi_fortran: tpnorm duplicates comm; the caller keeps it. */
static inline tpnorm_status_t tpnorm_comm_create_mpi(MPI_Comm comm, tpnorm_comm_t* out) {
  return tpnorm_comm_create_mpi_fortran((int)MPI_Comm_c2f(comm), out);
}

#endif /* TPNORM_C_API_MPI_H_ */
