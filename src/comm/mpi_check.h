// mpi_check.h — the MPI overloads of the TPNORM_CHECK family (see common/check.h).
#pragma once

#include <mpi.h>

#include <string>

namespace tpnorm::detail {

inline bool MPI_ok(int rc) { return rc == MPI_SUCCESS; }
inline std::string MPI_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(buf, len);
}

}  // namespace tpnorm::detail
