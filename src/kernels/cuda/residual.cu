// residual.cu — CUDA kernels of the fused residual add; see residual.h. Element-wise,
// grid-stride with 64-bit indices (tensors past 2^31 elements).
#include <algorithm>

#include "common/half.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/exact_device.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/residual.h"

namespace tpnorm::kernels::cuda {
namespace {

template <class T>
__global__ void __launch_bounds__(256)
    add_kernel(int64_t n, const T* x, const T* f, float alpha, T* h) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    h[i] = from_f<T>(__fadd_rn(__fmul_rn(alpha, to_f(x[i])), to_f(f[i])));
}

// Like every apply kernel, the epilogue honours the call's summed header: a rejected call
// leaves df (still the caller's, the norm's apply did not write it) and dx untouched. The
// error word is the norm's apply kernel's to set.
__device__ __forceinline__ bool accepted(const Header& hd) {
  if (hd.i64) {
    int64_t n = 0;
    return exact_header_ok(hd, &n);
  }
  double n = 0;
  return header_ok(hd, &n);
}

template <class T>
__global__ void __launch_bounds__(256)
    epilogue_kernel(Header hd, int64_t n, const T* dh_extra, float alpha, T* df, T* dx) {
  if (!accepted(hd)) return;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float dh = dh_extra ? __fadd_rn(to_f(df[i]), to_f(dh_extra[i])) : to_f(df[i]);
    df[i] = from_f<T>(dh);
    dx[i] = from_f<T>(__fmul_rn(alpha, dh));
  }
}

dim3 grid_for(int64_t n) {
  return dim3(static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 8192)));
}

}  // namespace

template <class T>
void residual_add(int64_t n, const T* x, const T* f, float alpha, T* h, void* stream) {
  using D = typename Dev<T>::type;
  if (n <= 0) return;
  launch("residual add", add_kernel<D>, grid_for(n), dim3(256), static_cast<cudaStream_t>(stream),
         n, reinterpret_cast<const D*>(x), reinterpret_cast<const D*>(f), alpha,
         reinterpret_cast<D*>(h));
}

template <class T>
void residual_backward_epilogue(const Header& hd, int64_t n, const T* dh_extra, float alpha,
                                T* df, T* dx, void* stream) {
  using D = typename Dev<T>::type;
  if (n <= 0) return;
  launch("residual epilogue", epilogue_kernel<D>, grid_for(n), dim3(256),
         static_cast<cudaStream_t>(stream), hd, n, reinterpret_cast<const D*>(dh_extra), alpha,
         reinterpret_cast<D*>(df), reinterpret_cast<D*>(dx));
}

#define TPNORM_CUDA_RESIDUAL_INSTANTIATE(T)                                     \
  template void residual_add<T>(int64_t, const T*, const T*, float, T*, void*); \
  template void residual_backward_epilogue<T>(const Header&, int64_t, const T*, float, T*, T*, \
                                              void*);
TPNORM_CUDA_RESIDUAL_INSTANTIATE(float)
TPNORM_CUDA_RESIDUAL_INSTANTIATE(f16)
TPNORM_CUDA_RESIDUAL_INSTANTIATE(bf16)

}  // namespace tpnorm::kernels::cuda
