// Host tests (no GPU needed) of the row kernels' accumulation order (kernels/cuda/row_norm.cu),
// replayed on the host in the kernels' own order and precision, thread by thread, for the
// launch plan the kernels use (kernels/cuda/plan.h):
// - partial_fwd at 2^20 and 2^24 columns per rank (a block of 256 threads per row, 4096 and
//   65536 values per thread): each chunk's values summed in float and flushed into double per
//   chunk, then the warp's shuffle tree and the block's warp-order sum in double. The row's
//   rstd must be within 1e-6 relative of the float64 two-pass reference (the tolerance of every
//   row-norm test). One float sum per thread across all chunks, with float shuffles, is
//   replayed too: within 1e-6 at 2^20 columns (about 1e-7), not at 2^24 (about 4e-6).
// - partial_bwd's per-block column sums of dy * xhat over 8192 rows (the most a block walks:
//   kBwdMaxParts blocks) stay in float: replayed, their error is far inside the dgamma
//   tolerance (r * rows + r |want|, r = 1e-5 for fp32), so they are kept in float (registers).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <random>
#include <vector>

#include "kernels/cuda/plan.h"

using namespace tpnorm::kernels::cuda;

namespace {

alignas(64) float g_align[16];

// The shuffle tree of group_sum (o = 16, 8, ..., 1: v[l] += v[l ^ o] at once) and the block's
// sum of the warps' results in warp order, in type A.
template <class A>
A group_sum(std::vector<A> v, int tpr) {
  for (int w = 0; w < tpr / 32; ++w)
    for (int o = 16; o > 0; o >>= 1) {
      std::vector<A> next(32);
      for (int l = 0; l < 32; ++l) next[l] = v[w * 32 + l] + v[w * 32 + (l ^ o)];
      for (int l = 0; l < 32; ++l) v[w * 32 + l] = next[l];
    }
  A s = 0;
  for (int w = 0; w < tpr / 32; ++w) s += v[w * 32];
  return s;
}

struct Sums {
  double s1, s2;
};

// partial_fwd's sums of d = x - pivot and d^2 over one row, in the kernel's order. flush: the
// kernel's order now (float per chunk, double across chunks); else float throughout.
Sums replay_partial_fwd(const std::vector<float>& x, float pivot, const RowPlan& p, bool flush) {
  const int tpr = p.tpr, V = p.vec, NP = p.per_thread / p.vec;
  const int packs = static_cast<int>(x.size()) / V;
  std::vector<double> d0(tpr), d1(tpr);
  std::vector<float> f0(tpr), f1(tpr);
  for (int lane = 0; lane < tpr; ++lane) {
    double a0 = 0, a1 = 0;
    float b0 = 0, b1 = 0;
    for (int c0 = lane; c0 < packs; c0 += tpr * NP) {
      float c0s = 0, c1s = 0;  // this chunk's sums (flush), else the thread's running ones
      float& t0 = flush ? c0s : b0;
      float& t1 = flush ? c1s : b1;
      for (int k = 0; k < NP; ++k) {
        if (c0 + k * tpr >= packs) continue;
        for (int e = 0; e < V; ++e) {
          const float d = x[static_cast<size_t>(c0 + k * tpr) * V + e] - pivot;
          t0 += d;
          t1 = std::fma(d, d, t1);  // nvcc contracts v += d * d
        }
      }
      if (flush) a0 += c0s, a1 += c1s;
    }
    d0[lane] = a0, d1[lane] = a1, f0[lane] = b0, f1[lane] = b1;
  }
  if (flush) return {group_sum(d0, tpr), group_sum(d1, tpr)};
  return {group_sum(f0, tpr), group_sum(f1, tpr)};
}

// rstd of a LayerNorm row from the kernel's sums (the apply's row_moments in double).
double rstd_of(const Sums& s, float pivot, double n, double eps) {
  const double p = pivot, s1 = p * n + s.s1, s2 = s.s2 + 2.0 * p * s.s1 + p * p * n;
  const double m = s1 / n, var = std::max(s2 / n - m * m, 0.0);
  return 1.0 / std::sqrt(var + eps);
}

struct Errors {
  double flushed = 0, float_only = 0;  // worst rstd relative errors over the offsets
};

Errors wide_row_errors(int64_t h, std::initializer_list<double> offsets) {
  const RowPlan p = plan_rows(1, h, sizeof(float), {g_align});
  EXPECT_EQ(p.tpr, kRowThreads) << "a block per row";
  std::printf("h %lld: tpr %d, vec %d, per_thread %d: %lld values per thread\n",
              static_cast<long long>(h), p.tpr, p.vec, p.per_thread,
              static_cast<long long>(h / p.tpr));
  const double eps = 1e-5;
  Errors worst;
  for (const double offset : offsets) {
    std::mt19937_64 rng(101 + static_cast<uint64_t>(offset));
    std::normal_distribution<double> nd(offset, 1.0);
    std::vector<float> x(static_cast<size_t>(h));
    for (float& v : x) v = static_cast<float>(nd(rng));
    double m = 0;
    for (float v : x) m += v;
    m /= static_cast<double>(h);
    double q = 0;
    for (float v : x) q += (v - m) * (v - m);
    const double want = 1.0 / std::sqrt(q / static_cast<double>(h) + eps);
    // The robust pivot: the mean of the first 32 values (common/pivot.h), in float.
    double ps = 0;
    for (int i = 0; i < 32; ++i) ps += static_cast<double>(x[i]) - x[0];
    const float pivot = static_cast<float>(x[0] + ps / 32);
    const double got = rstd_of(replay_partial_fwd(x, pivot, p, true), pivot, h, eps);
    const double old = rstd_of(replay_partial_fwd(x, pivot, p, false), pivot, h, eps);
    const double e_new = std::fabs(got - want) / want, e_old = std::fabs(old - want) / want;
    std::printf("  offset %g: rstd rel error %.3g (float per chunk, double across), %.3g (float "
                "throughout)\n",
                offset, e_new, e_old);
    worst.flushed = std::max(worst.flushed, e_new);
    worst.float_only = std::max(worst.float_only, e_old);
  }
  return worst;
}

// 2^20 columns per rank: both orders meet 1e-6 (float throughout is within ~1e-7 there).
TEST(GpuAccumulation, WideRowForwardStatisticsMeetOneMillionthAt2To20Columns) {
  const Errors e = wide_row_errors(int64_t{1} << 20, {0.0, 3.0, 100.0});
  EXPECT_LT(e.flushed, 1e-6);
  EXPECT_LT(e.flushed, e.float_only) << "flushing per chunk should not be worse";
}

// 2^24 columns per rank (65536 values per thread): one float sum per thread misses 1e-6,
// the kernel's flush per chunk does not.
TEST(GpuAccumulation, FlushPerChunkKeepsOneMillionthAt2To24Columns) {
  const Errors e = wide_row_errors(int64_t{1} << 24, {3.0});
  EXPECT_LT(e.flushed, 1e-6) << "the kernel's order misses the rstd tolerance";
  EXPECT_GT(e.float_only, 1e-6) << "the replay no longer shows what the flush is for";
}

TEST(GpuAccumulation, BackwardColumnSumsInFloatStayFarInsideTheDgammaTolerance) {
  const int64_t rows = 8192;  // one block's rows at kBwdMaxParts blocks
  std::mt19937_64 rng(202);
  std::normal_distribution<double> nd(0.0, 1.0);
  double worst_ratio = 0;
  for (int col = 0; col < 64; ++col) {
    float acc = 0;
    double want = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const float d = static_cast<float>(nd(rng)), xhat = static_cast<float>(nd(rng));
      acc = std::fma(d, xhat, acc);  // ag += d * xhat, contracted
      want += static_cast<double>(d) * xhat;
    }
    const double tol = 1e-5 * rows + 1e-5 * std::fabs(want);
    worst_ratio = std::max(worst_ratio, std::fabs(acc - want) / tol);
  }
  std::printf("worst column-sum error / dgamma tolerance over 64 columns: %.3g\n", worst_ratio);
  EXPECT_LT(worst_ratio, 0.01);
}

}  // namespace
