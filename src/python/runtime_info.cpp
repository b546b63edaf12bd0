// runtime_info.cpp — what the process loaded, for `python -m tpnorm` (tpnorm/__main__.py): the
// MPI, CUDA runtime and NCCL libraries this module's calls resolve to, their paths (dladdr on a
// function of each) and versions. A bug report needs the library that ran, which is not always
// the one the build linked (LD_LIBRARY_PATH, a library another module loaded first).
#include <dlfcn.h>
#include <mpi.h>
#include <pybind11/pybind11.h>

#include <string>

#ifdef TPNORM_WITH_CUDA
#include <cuda_runtime_api.h>
#endif
#ifdef TPNORM_WITH_NCCL
#include <nccl.h>
#endif

namespace py = pybind11;

namespace tpnorm::python {
namespace {

std::string path_of(const void* fn) {
  Dl_info info{};
  if (dladdr(fn, &info) && info.dli_fname) return info.dli_fname;
  return "";
}

py::dict mpi_info() {
  char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(version, &len);  // callable before MPI_Init
  int initialized = 0;
  MPI_Initialized(&initialized);
  py::dict d;
  d["version"] = std::string(version, len);
  d["path"] = path_of(reinterpret_cast<const void*>(&MPI_Get_library_version));
  d["initialized"] = bool(initialized);
  return d;
}

py::object cuda_info() {
#ifdef TPNORM_WITH_CUDA
  py::dict d;
  int runtime = 0;
  cudaRuntimeGetVersion(&runtime);
  d["runtime"] = runtime;
  d["path"] = path_of(reinterpret_cast<const void*>(&cudaRuntimeGetVersion));
  int devices = 0;
  cudaError_t e = cudaGetDeviceCount(&devices);
  d["devices"] = e == cudaSuccess ? devices : 0;
  d["device_error"] = e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e));
  cudaGetLastError();  // a failed query leaves nothing for the next CUDA call to report
  return d;
#else
  return py::none();
#endif
}

py::object nccl_info() {
#ifdef TPNORM_WITH_NCCL
  py::dict d;
  int version = 0;
  ncclGetVersion(&version);
  d["version"] = version;
  d["path"] = path_of(reinterpret_cast<const void*>(&ncclGetVersion));
  return d;
#else
  return py::none();
#endif
}

}  // namespace

void bind_runtime_info(py::module_& m) {
  m.def("mpi_info", &mpi_info, "the MPI library in use: version string, path, initialized");
  m.def("cuda_info", &cuda_info, "the CUDA runtime in use (None: built without CUDA)");
  m.def("nccl_info", &nccl_info, "the NCCL library in use (None: built without NCCL)");
}

}  // namespace tpnorm::python
