# python-torch.cmake — what a pip build (scikit-build-core: SKBUILD) takes from the torch it
# builds for. Included before cuda.cmake, only by pip builds: a plain CMake build keeps the
# CUDA toolkit and the NCCL the user points at (NCCL_ROOT), for the C++ library and its package.
#
# The extension module shares one process with torch, so it must use torch's CUDA runtime and
# torch's NCCL: two libnccl.so.2 in one process either fail to import (the first one loaded
# wins the soname and lacks the other's symbols) or, worse, bootstrap one communicator from
# another NCCL version. So:
#   - the CUDA backend is on only when torch is a CUDA build, nvcc is found (cuda.cmake) and
#     its CUDA major version is torch's; otherwise the package is CPU-only and says why;
#   - NCCL is the library torch itself maps at import (the nvidia-nccl wheel torch depends on),
#     read from /proc/self/maps of an interpreter that imported torch, with its headers
#     (../include); the module finds it at run time through its RPATH: relative to the module
#     when torch's wheels sit in the same site-packages, else the absolute path of the build;
#   - the CUDA runtime likewise: torch's libcudart from its wheel comes first on the RPATH.
# Sets TPNORM_TORCH_VERSION (empty: the build cannot import torch), TPNORM_TORCH_CUDA,
# TPNORM_TORCH_RPATH (for src/python) and TPNORM_BUILD_NOTES (lines for `python -m tpnorm`).
set(TPNORM_TORCH_VERSION "")
set(TPNORM_TORCH_CUDA "")
set(TPNORM_TORCH_RPATH "")
set(TPNORM_BUILD_NOTES "")
if(NOT SKBUILD)
  return()
endif()
if(NOT Python_EXECUTABLE)
  find_package(Python 3.8 COMPONENTS Interpreter)
endif()
execute_process(
  COMMAND ${Python_EXECUTABLE} -c "
import os, torch
maps = {l.split()[-1] for l in open('/proc/self/maps') if '/' in l}
def mapped(stem):
    return sorted(p for p in maps if os.path.basename(p).startswith(stem + '.so'))
print(torch.__version__)
print(torch.version.cuda or '')
print('|'.join(mapped('libnccl')))
print('|'.join(mapped('libcudart')))
print(os.path.dirname(os.path.dirname(torch.__file__)))"
  OUTPUT_VARIABLE _tq RESULT_VARIABLE _tq_rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _tq_rc EQUAL 0)
  # pip's default (isolated) build installs only the build requirements: torch is not there.
  set(TPNORM_CUDA OFF)
  set(TPNORM_CUDA_SAID ON)  # cuda.cmake: this line was the one about CUDA
  string(CONCAT TPNORM_BUILD_NOTES "the build could not import torch (pip's isolated build): CPU only, "
                         "no tpnorm._autograd; pip install --no-build-isolation . gives both")
  message(STATUS "tpnorm: CUDA backend off: ${TPNORM_BUILD_NOTES}")
  return()
endif()
string(REPLACE "\n" ";" _tq "${_tq}")
list(GET _tq 0 TPNORM_TORCH_VERSION)
list(GET _tq 1 TPNORM_TORCH_CUDA)
list(GET _tq 2 _nccl)
list(GET _tq 3 _cudart)
list(GET _tq 4 _site)
string(REPLACE "|" ";" _nccl "${_nccl}")
string(REPLACE "|" ";" _cudart "${_cudart}")

if(NOT TPNORM_CUDA)
  set(TPNORM_BUILD_NOTES "CUDA backend off: TPNORM_CUDA=OFF")
  return()
endif()
if(TPNORM_TORCH_CUDA STREQUAL "")
  set(TPNORM_CUDA OFF)
  set(TPNORM_CUDA_SAID ON)
  set(TPNORM_BUILD_NOTES "CUDA backend off: torch ${TPNORM_TORCH_VERSION} is a CPU build")
  message(STATUS "tpnorm: ${TPNORM_BUILD_NOTES}")
  return()
endif()

# The run-time search path of the module: torch's wheels, relative to the installed module
# (site-packages/tpnorm) when they share site-packages, then where they are now.
function(_tpnorm_torch_rpath dir)
  file(RELATIVE_PATH rel "${_site}/tpnorm" "${dir}")
  set(TPNORM_TORCH_RPATH ${TPNORM_TORCH_RPATH} "$ORIGIN/${rel}" "${dir}" PARENT_SCOPE)
endfunction()
list(LENGTH _cudart _n)
if(_n EQUAL 1)
  get_filename_component(_dir "${_cudart}" DIRECTORY)
  _tpnorm_torch_rpath("${_dir}")
endif()
list(LENGTH _nccl _n)
get_filename_component(_dir "${_nccl}" DIRECTORY)
if(_n EQUAL 1 AND EXISTS "${_dir}/../include/nccl.h")
  get_filename_component(_inc "${_dir}/../include" ABSOLUTE)
  set(NCCL_INCLUDE_DIR "${_inc}" CACHE PATH "NCCL headers (torch's)" FORCE)
  set(NCCL_LIBRARY "${_nccl}" CACHE FILEPATH "NCCL library (torch's)" FORCE)
  _tpnorm_torch_rpath("${_dir}")
  set(TPNORM_BUILD_NOTES "NCCL: torch's (${_nccl})")
else()
  # A torch with NCCL linked into itself (or none): a second NCCL would not be the one
  # torch's groups run on, so the module has the single-GPU and MPI-staged communicators.
  set(TPNORM_NCCL OFF)
  set(TPNORM_BUILD_NOTES "NCCL off: torch ${TPNORM_TORCH_VERSION} maps no libnccl with headers beside it")
endif()
