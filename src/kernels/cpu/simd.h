// simd.h — a minimal float32 vector for the CPU kernels: AVX-512 (16 lanes), AVX2 (8 lanes) or
// one scalar lane, chosen at compile time (-march=native by default).
//
// Why explicit vectors: the compiler's `omp simd` loops over lambdas kept one accumulator chain
// per sum, a horizontal reduction per block, and could not put streaming stores or prefetches in
// the loop. Kernels write their element formula once as a generic lambda over V = vf or float
// (lane-wise operators exist for both), run it over full vectors and then over the scalar tail.
// load_as / store_as convert fp16/bf16 lane by lane (a generic, slower path; fp32 is the fast one).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/half.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tpnorm::kernels::cpu {

#if defined(__AVX512F__) || defined(__AVX2__)
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// The vector type and its operations, written once for both widths: TPNORM_MM(op) names the
// intrinsic _mm512_op or _mm256_op.
#if defined(__AVX512F__)
#define TPNORM_MM(op) _mm512_##op
using vreg = __m512;
#elif defined(__AVX2__)
#define TPNORM_MM(op) _mm256_##op
using vreg = __m256;
#endif

#if defined(TPNORM_MM)
struct vf {
  static constexpr int L = sizeof(vreg) / sizeof(float);
  vreg v;
};
inline vf vload(const float* p) { return {TPNORM_MM(loadu_ps)(p)}; }
inline void vstore(float* p, vf a) { TPNORM_MM(storeu_ps)(p, a.v); }
// p: aligned to the vector (64 / 32 bytes).
inline void vstream(float* p, vf a) { TPNORM_MM(stream_ps)(p, a.v); }
inline vf vsplat(float s) { return {TPNORM_MM(set1_ps)(s)}; }
inline vf operator+(vf a, vf b) { return {TPNORM_MM(add_ps)(a.v, b.v)}; }
inline vf operator-(vf a, vf b) { return {TPNORM_MM(sub_ps)(a.v, b.v)}; }
inline vf operator*(vf a, vf b) { return {TPNORM_MM(mul_ps)(a.v, b.v)}; }
inline vf fmadd(vf a, vf b, vf c) { return {TPNORM_MM(fmadd_ps)(a.v, b.v, c.v)}; }
#undef TPNORM_MM
#if defined(__AVX512F__)
// Through memory: GCC 12 warns (-Wmaybe-uninitialized, a false positive) inside every
// in-register 512-to-256 extraction, _mm512_reduce_add_ps included. Once per block: cheap.
inline float hsum(vf a) {
  alignas(64) float b[16];
  _mm512_store_ps(b, a.v);
  return hsum8(_mm256_add_ps(_mm256_load_ps(b), _mm256_load_ps(b + 8)));
}
#else
inline float hsum(vf a) { return hsum8(a.v); }
#endif
#else
struct vf {
  static constexpr int L = 1;
  float v;
};
inline vf vload(const float* p) { return {*p}; }
inline void vstore(float* p, vf a) { *p = a.v; }
inline void vstream(float* p, vf a) { *p = a.v; }
inline vf vsplat(float s) { return {s}; }
inline vf operator+(vf a, vf b) { return {a.v + b.v}; }
inline vf operator-(vf a, vf b) { return {a.v - b.v}; }
inline vf operator*(vf a, vf b) { return {a.v * b.v}; }
inline vf fmadd(vf a, vf b, vf c) { return {a.v * b.v + c.v}; }
inline float hsum(vf a) { return a.v; }
#endif
inline vf& operator+=(vf& a, vf b) { return a = a + b; }
// The scalar form is fused too, whatever -ffp-contract says: an element in a row's scalar tail
// gets the bits it would get in a vector, which Stats::kExact needs at every world size (how a
// row is split decides which columns fall in a tail).
inline float fmadd(float a, float b, float c) { return std::fma(a, b, c); }

/// Orders earlier streaming stores before later loads/stores (e.g. before another thread reads).
inline void stream_fence() {
#if defined(__AVX512F__) || defined(__AVX2__)
  _mm_sfence();
#endif
}

/// splat<V>(s): s in every lane of V (vf or float).
template <class V>
inline V splat(float s) {
  if constexpr (std::is_same_v<V, vf>)
    return vsplat(s);
  else
    return s;
}

/// V::L (or 1) elements of T at p, as float lanes.
template <class V, class T>
inline V load_as(const T* p) {
  if constexpr (!std::is_same_v<V, vf>) {
    return to_float(*p);
  } else if constexpr (std::is_same_v<T, float>) {
    return vload(p);
  } else {
    alignas(64) float b[vf::L];
    for (int l = 0; l < vf::L; ++l) b[l] = to_float(p[l]);
    return vload(b);
  }
}

/// Stores the lanes of v at p as T (rounding once per element).
template <class T, class V>
inline void store_as(T* p, V v) {
  if constexpr (!std::is_same_v<V, vf>) {
    *p = from_float<T>(v);
  } else if constexpr (std::is_same_v<T, float>) {
    vstore(p, v);
  } else {
    alignas(64) float b[vf::L];
    vstore(b, v);
    for (int l = 0; l < vf::L; ++l) p[l] = from_float<T>(b[l]);
  }
}

}  // namespace tpnorm::kernels::cpu
