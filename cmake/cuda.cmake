# cuda.cmake — the optional CUDA backend of the tpnorm target.
#
# On when TPNORM_CUDA is ON (default) and a CUDA compiler is found (check_language); then
# src/kernels/cuda/*.cu and *.cpp (traffic.cpp: tpnorm/cuda_traffic.h), src/comm/cuda/*.cpp,
# src/ops/cuda/*.cpp and src/capi/cuda/*.cpp (the C API's device communicators,
# tpnorm/c_api_cuda.h) join the library, which
# links CUDA::cudart and, when found, NCCL::NCCL (NCCL_ROOT, else next to the toolkit).
# Architectures default to "80;90", as the `cuda` preset (below).
set(TPNORM_WITH_CUDA OFF)
set(TPNORM_WITH_NCCL OFF)
if(NOT TPNORM_CUDA)
  if(NOT TPNORM_CUDA_SAID)
    message(STATUS "tpnorm: CUDA backend off (TPNORM_CUDA=OFF)")
  endif()
  return()
endif()
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  message(STATUS "tpnorm: CUDA backend off: no CUDA compiler (nvcc) found")
  return()
endif()
# Ampere (sm_80) and Hopper (sm_90) machine code, each with its PTX: compute_90 PTX alone
# cannot run on an A100, and newer GPUs JIT the compute_90 PTX. Set CMAKE_CUDA_ARCHITECTURES
# to the cluster's GPUs to build faster (e.g. 90 for H100/H200 only).
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 80 90)
endif()
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
# A pip build for a CUDA torch (python-torch.cmake): kernels compiled by another CUDA major
# version than torch's would need a CUDA runtime that torch does not load.
if(TPNORM_TORCH_CUDA)
  string(REGEX MATCH "^[0-9]+" _torch_major "${TPNORM_TORCH_CUDA}")
  string(REGEX MATCH "^[0-9]+" _nvcc_major "${CMAKE_CUDA_COMPILER_VERSION}")
  if(NOT _torch_major STREQUAL _nvcc_major)
    string(CONCAT TPNORM_BUILD_NOTES "CUDA backend off: torch ${TPNORM_TORCH_VERSION} has CUDA "
                           "${TPNORM_TORCH_CUDA}, nvcc is ${CMAKE_CUDA_COMPILER_VERSION}")
    message(STATUS "tpnorm: ${TPNORM_BUILD_NOTES}")
    return()
  endif()
endif()
list(APPEND CMAKE_MODULE_PATH ${PROJECT_SOURCE_DIR}/cmake)
if(NOT DEFINED TPNORM_NCCL OR TPNORM_NCCL)
  find_package(NCCL)
endif()

file(GLOB TPNORM_CUDA_SOURCES CONFIGURE_DEPENDS
  src/kernels/cuda/*.cu src/kernels/cuda/*.cpp src/comm/cuda/*.cpp src/ops/cuda/*.cpp
  src/capi/cuda/*.cpp)
target_sources(tpnorm PRIVATE ${TPNORM_CUDA_SOURCES})
# The target was made before CUDA was enabled: give it the CUDA settings explicitly.
set_target_properties(tpnorm PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}"
                      CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
target_link_libraries(tpnorm PUBLIC CUDA::cudart)
if(TPNORM_TORCH_CUDA)
  # Inside torch's process: only the shared runtime that torch loaded, no private static copy.
  set_target_properties(tpnorm PROPERTIES CUDA_RUNTIME_LIBRARY Shared)
endif()
# NVTX3 (src/common/nvtx.h) is header-only; it looks for a profiler's injection library with dlopen.
target_link_libraries(tpnorm PUBLIC ${CMAKE_DL_LIBS})
target_compile_definitions(tpnorm PUBLIC TPNORM_WITH_CUDA=1)
if(NCCL_FOUND)
  target_link_libraries(tpnorm PUBLIC NCCL::NCCL)
  target_compile_definitions(tpnorm PUBLIC TPNORM_WITH_NCCL=1)
  set(TPNORM_WITH_NCCL ON)
else()
  message(STATUS "tpnorm: NCCL not found (set NCCL_ROOT); device ops use the MPI-staged "
                 "communicator only")
endif()
set(TPNORM_WITH_CUDA ON)
message(STATUS "tpnorm: CUDA backend on (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, "
               "architectures ${CMAKE_CUDA_ARCHITECTURES}, NCCL ${NCCL_VERSION} at ${NCCL_LIBRARY})")
