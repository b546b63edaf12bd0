// launch.cuh — every CUDA kernel of tpnorm is launched through launch(): it reports the error
// of THAT launch, from the launch's own return value (cudaLaunchKernelEx), never through
// cudaGetLastError, which may hold an earlier, unrelated call's error (the caller's, or
// another library's) and would make tpnorm throw for someone else.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

#include "common/cuda_check.h"

namespace tpnorm::kernels::cuda {

/// kernel<<<grid, block, 0, stream>>>(args...); throws tpnorm::Error(kCommunication) naming
/// `what` if this launch failed. The failed launch's error is then taken off the thread's
/// last-error slot, so no later check elsewhere reports it a second time.
template <class... Params, class... Args>
void launch(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
            Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();  // ours: the most recent failing call on this thread
  ::tpnorm::detail::throw_check_failure("CUDA", what, __FILE__, __LINE__,
                                        ::tpnorm::detail::CUDA_error_string(e));
}

/// Whether `kernel` may be launched as a programmatic dependent launch on the current device:
/// compute capability 9 or more AND the kernel's code built for sm_90 or later (code JIT-
/// compiled from older PTX has no grid-dependency wait, see device_common.cuh). Asked once
/// per (kernel, device).
inline bool programmatic_launch_ok(const void* kernel) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, bool> known;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return (void)cudaGetLastError(), false;
  const auto key = std::make_pair(kernel, dev);
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = known.find(key);
    if (it != known.end()) return it->second;
  }
  int major = 0;
  cudaFuncAttributes fa = {};
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaFuncGetAttributes(&fa, kernel) != cudaSuccess)
    return (void)cudaGetLastError(), false;  // ours: the call that just failed
  const bool ok = major >= 9 && fa.binaryVersion >= 90;
  std::lock_guard<std::mutex> lock(mu);
  known[key] = ok;
  return ok;
}

/// launch() as a programmatic dependent launch where programmatic_launch_ok: the kernel may
/// start while the previous kernel on the stream still runs, once every block of that kernel
/// has called allow_dependent_launch() or exited. Such a kernel reads nothing the previous
/// kernel writes before wait_for_previous_grid(), and every thread of it calls
/// wait_for_previous_grid() before it exits, so that its completion still implies the previous
/// kernel's for whatever the stream runs next (device_common.cuh). A plain launch elsewhere,
/// and when the driver refuses the attribute.
template <class... Params, class... Args>
void launch_dependent(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block,
                      cudaStream_t stream, const Args&... args) {
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = programmatic_launch_ok(reinterpret_cast<const void*>(kernel)) ? 1 : 0;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (e != cudaSuccess && cfg.numAttrs > 0) {
    (void)cudaGetLastError();  // ours; a plain launch instead
    cfg.numAttrs = 0;
    e = cudaLaunchKernelEx(&cfg, kernel, args...);
  }
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  ::tpnorm::detail::throw_check_failure("CUDA", what, __FILE__, __LINE__,
                                        ::tpnorm::detail::CUDA_error_string(e));
}

}  // namespace tpnorm::kernels::cuda
