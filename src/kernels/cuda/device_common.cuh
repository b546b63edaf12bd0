// device_common.cuh — what the CUDA kernels share: storage-type mapping and conversion to the
// float32 they compute in, 16-byte packs, group sums, and the check of a call's summed header
// (layout: common/call_header.h; the device view: kernels/cuda/call_header.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/call_header.h"
#include "common/half.h"
#include "common/pivot.h"
#include "kernels/cuda/call_header.h"

namespace tpnorm::kernels::cuda {

// Host storage types (common/half.h) are layout-compatible with the CUDA ones.
template <class T>
struct Dev {
  using type = T;
};
template <>
struct Dev<f16> {
  using type = __half;
};
template <>
struct Dev<bf16> {
  using type = __nv_bfloat16;
};
template <class T>
using DevT = typename Dev<T>::type;
/// A host storage pointer as the CUDA type it is laid out as (for kernel arguments).
template <class T>
const DevT<T>* dv(const T* p) {
  return reinterpret_cast<const DevT<T>*>(p);
}
template <class T>
DevT<T>* dv(T* p) {
  return reinterpret_cast<DevT<T>*>(p);
}

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// V elements loaded or stored as one access (16 bytes when V = 16 / sizeof(T)).
template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};
template <class T, int V>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p, int64_t i) {
  return reinterpret_cast<const Pack<T, V>*>(p)[i];
}
template <class T, int V>
__device__ __forceinline__ void store_pack(T* p, int64_t i, const Pack<T, V>& v) {
  reinterpret_cast<Pack<T, V>*>(p)[i] = v;
}

// Saved statistics and wire values are float or double, chosen at run time.
__device__ __forceinline__ double load_fd(const void* p, int64_t i, bool is64) {
  return is64 ? static_cast<const double*>(p)[i]
              : static_cast<double>(static_cast<const float*>(p)[i]);
}
__device__ __forceinline__ void store_fd(void* p, int64_t i, bool is64, double v) {
  if (is64)
    static_cast<double*>(p)[i] = v;
  else
    static_cast<float*>(p)[i] = static_cast<float>(v);
}

// Sum of K values (float, or int64 limbs) over the `tpr` threads of a row: a warp (tpr == 32,
// no shared memory, no block barrier) or the whole block (tpr == blockDim.x: every thread must
// call). The block case adds the warps' sums in a fixed order, so every thread gets the same
// bits.
template <int K, class T>
__device__ __forceinline__ void group_sum(T (&v)[K], int tpr) {
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
  if (tpr <= 32) return;
  __shared__ T sm[32][K];
  const int w = threadIdx.x / 32, nw = blockDim.x / 32;
  __syncthreads();
  if (threadIdx.x % 32 == 0)
#pragma unroll
    for (int k = 0; k < K; ++k) sm[w][k] = v[k];
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    T s = 0;
    for (int i = 0; i < nw; ++i) s += sm[i][k];
    v[k] = s;
  }
}

// The summed header of the call (layout: common/call_header.h): true when no rank failed and
// every fingerprint chunk agrees; *n = the global element count per statistic set.
__device__ __forceinline__ bool header_ok(const Header& hd, double* n) {
  namespace ch = detail::call_header;
  bool bad = load_fd(hd.base, ch::kErrorIndex, hd.w64) != 0.0;
  // ch::chunk_index(i), spelled out: host constexpr functions are not callable on device.
  for (int i = 0; i < ch::kChunks && ch::kBaseValues + 2 * i + 1 < hd.values; ++i) {
    const double s1 = load_fd(hd.base, ch::kBaseValues + 2 * i, hd.w64);
    const double s2 = load_fd(hd.base, ch::kBaseValues + 2 * i + 1, hd.w64);
    if (static_cast<double>(hd.ranks) * s2 != s1 * s1) bad = true;
  }
  *n = load_fd(hd.base, hd.count_at >= 0 ? hd.count_at : ch::kCountIndex, hd.w64);
  if (!hd.w64 && *n >= ch::kFloatCountLimit) bad = true;  // float counts stop being exact
  if (hd.count_want >= 0 && *n != hd.count_want) bad = true;  // slices that do not tile
  return !bad;
}

// A rank's header written by the kernel that was handed it (block 0, thread 0; nh <= 10).
__device__ __forceinline__ void write_header_values(const HeaderWrite& hw) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
#pragma unroll
  for (int i = 0; i < detail::call_header::kFullValues; ++i)
    if (i < hw.nh) store_fd(hw.base, i, hw.w64, hw.v[i]);
}

// The op's payload (its statistics) in the summed buffer.
__device__ __forceinline__ const void* payload_of(const Header& hd) {
  const int64_t at = hd.payload_at >= 0 ? hd.payload_at : hd.values;
  return static_cast<const char*>(hd.base) + at * (hd.w64 ? 8 : 4);
}

// Marks the call failed (any thread may call; one write wins, the value is the same).
__device__ __forceinline__ void mark_failed(int* err) {
  if (threadIdx.x == 0) atomicExch(err, 1);
}

// Programmatic dependent launch (launch_dependent, launch.cuh); no-ops below sm_90, where
// launch_dependent never sets the attribute. allow_dependent_launch: a kernel that the next
// one does not depend on lets it start now. wait_for_previous_grid: the previous kernel has
// completed and its writes are visible.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();
#endif
}
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
#endif
}

// The exact split of a saved mean into float head + tail (as kernels/cpu/row_norm.cpp).
__device__ __forceinline__ void split_mean(double m, float& head, float& tail) {
  head = static_cast<float>(m);
  tail = static_cast<float>(m - static_cast<double>(head));
}

}  // namespace tpnorm::kernels::cuda
