// pivot.h — the robust pivot: the one rule every kernel (CPU and CUDA, rows and channels) uses
// to centre its forward sums.
//
// In the robust mode a kernel sums d = x - pivot in float32 (blocks or threads), adds the
// partial sums in double, and shifts them back exactly: sum x = p*n + sum d,
// sum x^2 = sum d^2 + 2p sum d + p^2 n. This keeps 1e4 + N(0,1) from cancelling only if the
// pivot sits near the values' mean: the float32 sums of d^2 then stay about n*var, and their
// rounding is relative to the variance itself.
//
// The rule: the mean of the first kPivotSpan values (all of them when fewer), accumulated in
// double around the first value, rounded to float. Why 32: the saved rstd (float) of 512
// seeded rows of 1e4 + N(0,1), 8192 wide, against a float64 reference, relative error median /
// max, with float32 sums of d in the CPU kernels' order (loops.h, 16 lanes) and in the CUDA
// row kernel's (256 threads a row, packs of 4, warp butterflies, warps added in order):
//   span   1 (x[0])   CPU 5.3e-8 / 2.4e-7   GPU 1.4e-7 / 1.0e-6
//   span   8          CPU 2.8e-8 / 1.3e-7   GPU 1.1e-7 / 2.5e-7
//   span  32          CPU 2.4e-8 / 9.0e-8   GPU 1.0e-7 / 2.3e-7
//   span 128          CPU 2.4e-8 / 8.3e-8   GPU 1.1e-7 / 2.2e-7
// x[0] alone can sit 3 standard deviations out and then costs up to 1e-6 (the GPU tests check
// 1e-6); 8 values already remove most of it, 32 leave the worst row at a quarter of the bound,
// and 128 buy nothing more while reading further into the row before the sums start.
#pragma once

#include <cstdint>

#include "common/half.h"
#include "common/host_device.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif
#if defined(__AVX__) && !defined(__CUDACC__)
#include <immintrin.h>

#include <type_traits>
#endif

namespace tpnorm::detail {

/// How many leading values the pivot averages (see above for the measurement).
constexpr int64_t kPivotSpan = 32;

/// The pivot of n values (n may be 0: returns 0 and calls nothing); value(i) -> float is the
/// i-th value, i < min(n, kPivotSpan). The one implementation; the forms below are views on it.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Value>
TPNORM_HD inline float robust_pivot(int64_t n, Value value) {
  if (n <= 0) return 0.0f;
  const int64_t k = n < kPivotSpan ? n : kPivotSpan;
  const double first = static_cast<double>(value(int64_t{0}));
  // Four partial sums: one chain of 32 dependent double adds is ~130 cycles a row, as long as
  // the rest of a 512-wide row's forward; four chains of 8 overlap.
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= k; i += 4) {
    s0 += static_cast<double>(value(i)) - first;
    s1 += static_cast<double>(value(i + 1)) - first;
    s2 += static_cast<double>(value(i + 2)) - first;
    s3 += static_cast<double>(value(i + 3)) - first;
  }
  for (; i < k; ++i) s0 += static_cast<double>(value(i)) - first;
  const double s = (s0 + s1) + (s2 + s3);
  return static_cast<float>(first + s / static_cast<double>(k));
}

/// A stored value as float: host storage types here, the CUDA ones under nvcc.
TPNORM_HD inline float pivot_value(float v) { return v; }
inline float pivot_value(f16 v) { return to_float(v); }
inline float pivot_value(bf16 v) { return to_float(v); }
#if defined(__CUDACC__)
TPNORM_HD inline float pivot_value(__half v) { return __half2float(v); }
TPNORM_HD inline float pivot_value(__nv_bfloat16 v) { return __bfloat162float(v); }
#endif

/// Reads x[i * stride] as float (a named functor rather than a lambda: nvcc checks a lambda's
/// calls for both sides, and pivot_value(f16) exists on the host only).
template <class T>
struct StridedValues {
  const T* x;
  int64_t stride;
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
  TPNORM_HD float operator()(int64_t i) const { return pivot_value(x[i * stride]); }
};

#if defined(__AVX__) && !defined(__CUDACC__)
/// robust_pivot of kPivotSpan contiguous float32 values, bit for bit: its four chains (chain c
/// adds x[c], x[c + 4], ... in order) are the four double lanes of one vector, and the lanes are
/// added as it adds the chains. A quarter of the instructions of the scalar form (~100 a row),
/// which the CPU kernels run once per row of every forward.
inline float contiguous_pivot(const float* x) {
  static_assert(kPivotSpan % 4 == 0, "whole vectors of 4 doubles, no tail");
  const double first = static_cast<double>(x[0]);
  const __m256d f = _mm256_set1_pd(first);
  __m256d s = _mm256_setzero_pd();
  for (int64_t i = 0; i < kPivotSpan; i += 4)
    s = _mm256_add_pd(s, _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i)), f));
  alignas(32) double c[4];
  _mm256_store_pd(c, s);
  const double sum = (c[0] + c[1]) + (c[2] + c[3]);
  return static_cast<float>(first + sum / static_cast<double>(kPivotSpan));
}
#endif

/// The pivot of x[0], x[stride], ..., x[(n-1)*stride]: a row (stride 1), an NCHW channel's
/// plane (stride 1) or a channels-last channel (stride = channels).
template <class T>
TPNORM_HD inline float robust_pivot(const T* x, int64_t n, int64_t stride = 1) {
#if defined(__AVX__) && !defined(__CUDACC__)
  if constexpr (std::is_same_v<T, float>)
    if (stride == 1 && n >= kPivotSpan) return contiguous_pivot(x);
#endif
  return robust_pivot(n, StridedValues<T>{x, stride});
}

/// The pivot of channel ch of this rank's SyncBatchNorm input: n samples of c channels with
/// `inner` positions each, NCHW ([n, c, inner]) or channels-last ([n, inner, c]). NCHW: sample
/// 0's plane of the channel (inner contiguous values); channels-last: the channel's first values
/// over all n * inner positions (stride c). No values (n or inner 0): 0, and x is not read.
template <class T>
TPNORM_HD inline float channel_pivot(const T* x, int64_t n, int64_t c, int64_t inner,
                                     bool channels_last, int64_t ch) {
  if (n <= 0 || inner <= 0) return 0.0f;
  return channels_last ? robust_pivot(x + ch, n * inner, c) : robust_pivot(x + ch * inner, inner);
}

}  // namespace tpnorm::detail
