// launch.cuh — every CUDA kernel of tpnorm is launched through launch(): it reports the error
// of THAT launch, from the launch's own return value (cudaLaunchKernelEx), never through
// cudaGetLastError, which may hold an earlier, unrelated call's error (the caller's, or
// another library's) and would make tpnorm throw for someone else.
#pragma once

#include <cuda_runtime.h>

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

}  // namespace tpnorm::kernels::cuda
