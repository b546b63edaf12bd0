// exact_channels_math.h — what the CUDA kernels of Stats::kExact for SyncBatchNorm
// (kernels/cuda/exact_channels.cu) compute, as plain C++ marked TPNORM_HD, no CUDA types: the
// split of a channel's elements over blocks, the walks of a thread over its elements, one
// thread's exact sums, the adding of the blocks' limbs, and the per-channel and per-element
// arithmetic of the CPU's kExact path (kernels/cpu/exact_channels.cpp, ops/batch_norm.cpp,
// kernels/cpu/batch_norm.cpp). The kernels call these functions; the host test
// (tests/gpu/host_test_gpu_exact_bn.cpp) calls the same functions the way the kernels do and
// compares the result with the CPU op, bit for bit.
//
// Rounding: every floating-point operation is spelled as one rn:: call, which is the
// correctly rounded intrinsic on the device (__fsub_rn, __fmaf_rn, __ddiv_rn, ...: nvcc
// contracts none of them into an FMA) and the plain operator on the host (compiled with
// -ffp-contract=off, so the host computes what the CPU kernels do). The CPU's one fused
// operation, y = fma(xc, scale, shift), is rn::fma.
//
// Geometry: both layouts as [outer, c, inner] (kernels/cuda/batch_norm.h's BnArgs): channel
// ch's element k (0 <= k < outer * inner) sits at (k / inner * c + ch) * inner + k % inner.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "common/exact_sum.h"
#include "kernels/cuda/exact_acc.h"

namespace tpnorm::kernels::cuda {

// ---- rounding ---------------------------------------------------------------------------

namespace rn {
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double dadd(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double dsub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double dmul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double ddiv(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ double dsqrt(double a) { return __dsqrt_rn(a); }
__device__ __forceinline__ double nan() { return __longlong_as_double(0x7ff8000000000000LL); }
#else
inline float sub(float a, float b) { return a - b; }
inline float mul(float a, float b) { return a * b; }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline double dadd(double a, double b) { return a + b; }
inline double dsub(double a, double b) { return a - b; }
inline double dmul(double a, double b) { return a * b; }
inline double ddiv(double a, double b) { return a / b; }
inline double dsqrt(double a) { return std::sqrt(a); }
inline double nan() { return std::numeric_limits<double>::quiet_NaN(); }
#endif
}  // namespace rn

// ---- the split and the walks ----------------------------------------------------------------

inline constexpr int kBnExactThreads = 256;
inline constexpr int kBnFwdLimbs = exact::moment_limbs(true);   ///< {bad, sum x, sum x^2}
inline constexpr int kBnBwdLimbs = exact::moment_limbs(false);  ///< {bad, sum dy, sum dy*xmu}
inline constexpr int kWords1 = static_cast<int>(sizeof(exact::Sum1) / sizeof(uint64_t));
inline constexpr int kWords2 = static_cast<int>(sizeof(exact::Sum2) / sizeof(uint64_t));

/// Blocks a channel's elements are split over: enough blocks in all to fill the GPU
/// (kBnExactTargetBlocks), none with fewer than kBnExactMinSplit elements (32 a thread), at
/// most kBnExactMaxSplits. The splits' limbs are added as int64 like the ranks' limbs, so
/// their number stays within exact_sum.h's headroom (kMaxRanks addends).
inline constexpr int64_t kBnExactTargetBlocks = 1024;
inline constexpr int64_t kBnExactMinSplit = 32 * kBnExactThreads;
inline constexpr int64_t kBnExactMaxSplits = 1024;
static_assert(kBnExactMaxSplits <= exact::kMaxRanks, "split limbs add within the headroom");

struct BnExactPlan {
  int64_t outer = 0, c = 0, inner = 1;
  int64_t m = 0;       ///< elements per channel on this rank (outer * inner)
  int64_t splits = 0;  ///< blocks per channel; >= 1 when c > 0 (no element: one block of zeros)
  int64_t per = 0;     ///< elements per split (the last one may have fewer, none has 0 when m > 0)
};

inline BnExactPlan bn_exact_plan(int64_t outer, int64_t c, int64_t inner) {
  BnExactPlan p;
  p.outer = outer > 0 ? outer : 0;
  p.c = c > 0 ? c : 0;
  p.inner = inner > 0 ? inner : 1;
  p.m = inner > 0 ? p.outer * inner : 0;
  if (p.c == 0) return p;
  int64_t s = (kBnExactTargetBlocks + p.c - 1) / p.c;
  const int64_t by_size = (p.m + kBnExactMinSplit - 1) / kBnExactMinSplit;
  if (s > by_size) s = by_size;
  if (s > kBnExactMaxSplits) s = kBnExactMaxSplits;
  if (s < 1) s = 1;
  p.per = (p.m + s - 1) / s;
  p.splits = p.per > 0 ? (p.m + p.per - 1) / p.per : 1;  // no empty split
  return p;
}

/// Blocks of kBnExactThreads for the apply's grid-stride loop over `total` elements (at least
/// one, so that a call without elements still checks its header; at most 2^16).
inline int64_t bn_apply_blocks(int64_t total) {
  const int64_t b = (total + kBnExactThreads - 1) / kBnExactThreads;
  return b < 1 ? 1 : b > (int64_t{1} << 16) ? int64_t{1} << 16 : b;
}

/// Elements [k0, k1) of split sp.
TPNORM_HD inline void bn_split_range(const BnExactPlan& p, int64_t sp, int64_t* k0, int64_t* k1) {
  *k0 = sp * p.per;
  *k1 = *k0 + p.per < p.m ? *k0 + p.per : p.m;
  if (*k0 > *k1) *k0 = *k1;
}

/// Thread t of nt in split sp: elements k0 + t, k0 + t + nt, ... below k1, tracked as
/// k = o * inner + s without a division per element.
struct BnChannelWalk {
  int64_t o = 0, s = 0, left = 0, dq = 0, ds = 0;

  TPNORM_HD static BnChannelWalk start(const BnExactPlan& p, int64_t sp, int t, int nt) {
    BnChannelWalk w;
    int64_t k0, k1;
    bn_split_range(p, sp, &k0, &k1);
    const int64_t k = k0 + t;
    w.left = k < k1 ? (k1 - k + nt - 1) / nt : 0;
    w.o = k / p.inner;
    w.s = k % p.inner;
    w.dq = nt / p.inner;
    w.ds = nt % p.inner;
    return w;
  }
  /// The element's offset in the tensor (channel ch).
  TPNORM_HD int64_t at(const BnExactPlan& p, int64_t ch) const {
    return (o * p.c + ch) * p.inner + s;
  }
  TPNORM_HD void next(const BnExactPlan& p) {
    --left;
    o += dq;
    s += ds;
    if (s >= p.inner) s -= p.inner, ++o;
  }
};

/// Element i of the whole tensor and its channel (i / inner) % c, for a grid-stride loop
/// (i += step), without a division per element.
struct BnFlatWalk {
  int64_t i = 0, ch = 0, s = 0, dch = 0, ds = 0, step = 1;

  TPNORM_HD static BnFlatWalk start(int64_t i0, int64_t step, int64_t c, int64_t inner) {
    BnFlatWalk w;
    w.i = i0;
    w.s = i0 % inner;
    w.ch = (i0 / inner) % c;
    w.step = step;
    w.ds = step % inner;
    w.dch = (step / inner) % c;
    return w;
  }
  TPNORM_HD void next(int64_t c, int64_t inner) {
    i += step;
    s += ds;
    int64_t q = dch;
    if (s >= inner) s -= inner, ++q;
    ch += q;  // q <= c: one subtraction brings ch back below c
    if (ch >= c) ch -= c;
  }
};

// ---- one thread's exact sums (the block adds the threads' limbs as int64) ------------------

/// The largest good biased exponent of the values load(offset) -> float bits of thread t's
/// elements of (ch, sp); each of `terms` values per element (1: x; 2: dy and dy*xmu) has its own.
template <int N, class Load>
TPNORM_HD inline void bn_thread_emax(const BnExactPlan& p, int64_t ch, int64_t sp, int t, int nt,
                                     Load load, int (&emax)[N]) {
  for (int j = 0; j < N; ++j) emax[j] = 0;
  for (BnChannelWalk w = BnChannelWalk::start(p, sp, t, nt); w.left > 0; w.next(p)) {
    uint32_t u[N];
    load(w.at(p, ch), u);
    for (int j = 0; j < N; ++j) {
      const int e = exact_good_exponent(u[j]);
      emax[j] = e > emax[j] ? e : emax[j];
    }
  }
}

/// Thread t's limbs of (ch, sp), with the block's largest exponents: forward (N = 1, load
/// gives x) {bad, sum x, sum x^2}; backward (N = 2, load gives dy and dy*xmu) {bad, sum dy,
/// sum dy*xmu}: exact::pack's layout, not yet normalized after the adds.
template <int N, class Load>
TPNORM_HD inline void bn_thread_limbs(const BnExactPlan& p, int64_t ch, int64_t sp, int t, int nt,
                                      Load load, const int (&emax)[N],
                                      int64_t (&l)[N == 1 ? kBnFwdLimbs : kBnBwdLimbs]) {
  static_assert(N == 1 || N == 2, "forward: x; backward: dy, dy*xmu");
  if constexpr (N == 1) {
    ExactAcc<true> a(emax[0]);
    for (BnChannelWalk w = BnChannelWalk::start(p, sp, t, nt); w.left > 0; w.next(p)) {
      uint32_t u[1];
      load(w.at(p, ch), u);
      a.add(u[0]);
    }
    a.flush();
    l[0] = a.bad;
    exact::pack(a.s1, l + 1, exact::kLimbs1);
    exact::pack(a.s2, l + 1 + exact::kLimbs1, exact::kLimbs2);
  } else {
    ExactAcc<false> a(emax[0]), b(emax[1]);
    for (BnChannelWalk w = BnChannelWalk::start(p, sp, t, nt); w.left > 0; w.next(p)) {
      uint32_t u[2];
      load(w.at(p, ch), u);
      a.add(u[0]);
      b.add(u[1]);
    }
    a.flush();
    b.flush();
    l[0] = a.bad + b.bad;
    exact::pack(a.s1, l + 1, exact::kLimbs1);
    exact::pack(b.s1, l + 1 + exact::kLimbs1, exact::kLimbs1);
  }
}

/// Limbs summed as int64 (over a block's threads, or over a channel's splits) back into
/// exact::pack's layout: k = kBnFwdLimbs {bad, Sum1, Sum2} or kBnBwdLimbs {bad, Sum1, Sum1}.
TPNORM_HD inline void bn_normalize(int64_t* l, int k) {
  exact_normalize<kWords1>(l + 1, exact::kLimbs1);
  if (k == kBnFwdLimbs)
    exact_normalize<kWords2>(l + 1 + exact::kLimbs1, exact::kLimbs2);
  else
    exact_normalize<kWords1>(l + 1 + exact::kLimbs1, exact::kLimbs1);
}

/// The backward's two terms of an element, as kernels/cpu/exact_channels.cpp forms them:
/// dy and dy * ((x - mh) - mt).
TPNORM_HD inline void bn_bwd_terms(float dy, float x, float mh, float mt, float* a, float* b) {
  *a = dy;
  *b = rn::mul(dy, rn::sub(rn::sub(x, mh), mt));
}

// ---- per channel --------------------------------------------------------------------------

/// The exact split of a mean into float head + tail (kernels/cpu/loops.h split_mean).
TPNORM_HD inline void bn_split_mean(double m, float* head, float* tail) {
  *head = static_cast<float>(m);
  *tail = static_cast<float>(rn::dsub(m, static_cast<double>(*head)));
}

/// exact_channels.cpp bn_exact_moments: mean and biased variance of summed forward limbs,
/// each rounded once (NaN for a channel with a bad value, 0 for n == 0).
TPNORM_HD inline void bn_exact_moments(const int64_t* in, uint64_t n, double* mean, double* var) {
  if (in[0] != 0 || n == 0) {
    *mean = *var = in[0] != 0 ? rn::nan() : 0.0;
    return;
  }
  const exact::Sum1 s1 = exact::unpack<kWords1>(in + 1, exact::kLimbs1);
  *mean = exact::mean(s1, n);
  *var = exact::variance(s1, exact::unpack<kWords2>(in + 1 + exact::kLimbs1, exact::kLimbs2), n);
}

/// exact_channels.cpp bn_exact_backward_sums: {sum dy / d, sum dy*xmu / d} of backward limbs,
/// each rounded once (NaN for a bad channel, 0 for d == 0).
TPNORM_HD inline void bn_exact_backward_sums(const int64_t* in, uint64_t d, double* s0,
                                             double* s1) {
  if (in[0] != 0 || d == 0) {
    *s0 = *s1 = in[0] != 0 ? rn::nan() : 0.0;
    return;
  }
  *s0 = exact::mean(exact::unpack<kWords1>(in + 1, exact::kLimbs1), d);
  *s1 = exact::mean(exact::unpack<kWords1>(in + 1 + exact::kLimbs1, exact::kLimbs1), d);
}

/// batch_norm.cpp BnForwardOp::apply: invstd = 1 / sqrt(var + eps), in double.
TPNORM_HD inline double bn_invstd(double var, double eps) {
  return rn::ddiv(1.0, rn::dsqrt(rn::dadd(var, eps)));
}

/// batch_norm.cpp update_running: rm = (1 - m) rm + m mean, rv = (1 - m) rv + m var n / (n - 1)
/// (the unbiased variance), in double, in that order.
TPNORM_HD inline void bn_update_running(double mean, double var, double n, double m, double* rm,
                                        double* rv) {
  *rm = rn::dadd(rn::dmul(rn::dsub(1.0, m), *rm), rn::dmul(m, mean));
  *rv = rn::dadd(rn::dmul(rn::dsub(1.0, m), *rv),
                 rn::ddiv(rn::dmul(rn::dmul(m, var), n), rn::dsub(n, 1.0)));
}

/// batch_norm.cpp bn_apply_forward's per-channel constants: head, tail of the mean, scale =
/// float(invstd) * gamma, shift = beta (gamma 1 and beta 0 when absent).
struct BnFwdConsts {
  float h, t, scale, shift;
};
TPNORM_HD inline BnFwdConsts bn_fwd_consts(double mean, double invstd, float gamma, float beta) {
  BnFwdConsts k;
  bn_split_mean(mean, &k.h, &k.t);
  k.scale = rn::mul(static_cast<float>(invstd), gamma);
  k.shift = beta;
  return k;
}
/// y = fma((x - h) - t, scale, shift).
TPNORM_HD inline float bn_exact_y(float x, const BnFwdConsts& k) {
  return rn::fma(rn::sub(rn::sub(x, k.h), k.t), k.scale, k.shift);
}

/// batch_norm.cpp bn_apply_backward's per-channel constants with the exact path's n = 1 (the
/// sums already divided by the global count; eval: zero sums and c1 = c2 = 0): k = float(invstd
/// * gamma), c1 = float(s0), c2 = float(invstd * invstd * s1), all in double.
struct BnBwdConsts {
  float h, t, k, c1, c2;
};
TPNORM_HD inline BnBwdConsts bn_bwd_consts(double mean, double invstd, float gamma, bool training,
                                           double s0, double s1) {
  BnBwdConsts k;
  bn_split_mean(mean, &k.h, &k.t);
  k.k = static_cast<float>(rn::dmul(invstd, static_cast<double>(gamma)));
  k.c1 = training ? static_cast<float>(s0) : 0.0f;
  k.c2 = training ? static_cast<float>(rn::dmul(rn::dmul(invstd, invstd), s1)) : 0.0f;
  return k;
}
/// dx = k ((dy - c1) - ((x - h) - t) c2) (eval too: the CPU reads x there as well).
TPNORM_HD inline float bn_exact_dx(float dy, float x, const BnBwdConsts& k) {
  const float xc = rn::sub(rn::sub(x, k.h), k.t);
  return rn::mul(k.k, rn::sub(rn::sub(dy, k.c1), rn::mul(xc, k.c2)));
}

/// batch_norm.cpp bn_param_grads from this rank's sums (rounded once): dgamma = float(invstd *
/// s1), dbeta = float(s0).
TPNORM_HD inline float bn_dgamma(double invstd, double s1) {
  return static_cast<float>(rn::dmul(invstd, s1));
}

}  // namespace tpnorm::kernels::cuda
