// Host tests (no GPU needed) of the GPU's exact accumulator (kernels/cuda/exact_acc.h), the
// arithmetic the CUDA kernels of Stats::kExact run per thread: the row's values dealt to
// `threads` threads as the kernels' lanes take them (value i to thread i % threads), each
// thread's window sums, its limbs added over the threads as int64 and normalized (as
// kernels/cuda/exact_rows.cu partial_fwd / partial_bwd) must be the limbs the CPU packs from its
// own exact sums (kernels/cpu/exact_bins.h exact_accumulate, itself checked against Python's
// integers in tests/unit/test_exact_sum.cpp): the same payload integers, for any thread count.
// Data: the Python-checked table of tests/unit (whose sums the GPU limbs must also give directly,
// against Python's integers), normal data around offsets, values spread over more than the
// window (the slow path), subnormals, values under 2^-79 whose squares are truncated to the
// grid (all through the direct path), signed zeros, bad values, and more than kExactFlush values
// a thread at the top of the range (the flush and its headroom).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/exact_sum.h"
#include "kernels/cpu/exact_bins.h"
#include "kernels/cpu/exact_rows.h"
#include "kernels/cuda/exact_acc.h"
#include "kernels/cuda/exact_rows.h"

namespace {

using namespace tpnorm;
using kernels::cuda::ExactAcc;

uint32_t bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

constexpr int kL1 = exact::kLimbs1, kL2 = exact::kLimbs2;
constexpr int kFwd = 1 + kL1 + kL2;  // {bad, sum x, sum x^2}

// The GPU partial's limbs of one row of values: {bad, sum x (kLimbs1), sum x^2 (kLimbs2)} with
// squares, {bad, sum x (kLimbs1)} without.
std::vector<int64_t> gpu_limbs(const std::vector<float>& x, int threads, bool squares) {
  int emax = 0;
  for (float v : x) emax = std::max(emax, kernels::cuda::exact_good_exponent(bits(v)));
  const int k = squares ? kFwd : 1 + kL1;
  std::vector<int64_t> sum(k, 0), mine(k);
  for (int t = 0; t < threads; ++t) {
    ExactAcc<true> acc(emax);
    ExactAcc<false> acc1(emax);
    for (size_t i = t; i < x.size(); i += threads)
      (squares ? acc.add(bits(x[i])) : acc1.add(bits(x[i])));
    acc.flush();
    acc1.flush();
    mine[0] = squares ? acc.bad : acc1.bad;
    exact::pack(squares ? acc.s1 : acc1.s1, mine.data() + 1, kL1);
    if (squares) exact::pack(acc.s2, mine.data() + 1 + kL1, kL2);
    for (int i = 0; i < k; ++i) sum[i] += mine[i];  // int64, as the kernels' group sums
  }
  kernels::cuda::exact_normalize<4>(sum.data() + 1, kL1);
  if (squares) kernels::cuda::exact_normalize<8>(sum.data() + 1 + kL1, kL2);
  return sum;
}

// The CPU's limbs of the same values (kernels/cpu/exact_rows.cpp's packing).
std::vector<int64_t> cpu_limbs(const std::vector<float>& x, bool squares) {
  exact::Sum1 s1;
  exact::Sum2 s2;
  int64_t bad = 0;
  kernels::cpu::exact_accumulate(x.data(), static_cast<int64_t>(x.size()), s1,
                                 squares ? &s2 : nullptr, bad);
  std::vector<int64_t> out(squares ? kFwd : 1 + kL1);
  out[0] = bad;
  exact::pack(s1, out.data() + 1, kL1);
  if (squares) exact::pack(s2, out.data() + 1 + kL1, kL2);
  return out;
}

void expect_same(const std::vector<float>& x, const std::string& what) {
  for (bool squares : {true, false}) {
    const std::vector<int64_t> want = cpu_limbs(x, squares);
    for (int threads : {1, 3, 32, 256}) {
      EXPECT_EQ(gpu_limbs(x, threads, squares), want)
          << what << ": " << x.size() << " values, " << threads << " threads"
          << (squares ? ", with squares" : ", values only");
    }
  }
}

struct TableCase {
  const char* name;
  std::vector<std::pair<double, int>> values;  // float32 value, repeat count
  const char* s1;
  const char* s2;
  int64_t bad, n;
  double mean, var, mean_square;
};

const TableCase kTable[] = {
#include "../unit/data/exact_sum_cases.inc"
};

// Decimal digits of a two's-complement wide integer.
template <int W>
std::string decimal(exact::Wide<W> a) {
  const bool neg = exact::is_negative(a);
  if (neg) a = exact::negated(a);
  std::string s;
  do {
    s.push_back(static_cast<char>('0' + exact::divide(a, 10)));
  } while (!exact::is_zero(a));
  if (neg) s.push_back('-');
  return std::string(s.rbegin(), s.rend());
}

TEST(GpuExactAcc, PythonTableGivesTheCpuLimbs) {
  for (const TableCase& c : kTable) {
    std::vector<float> x;
    for (const auto& [v, k] : c.values) x.insert(x.end(), k, static_cast<float>(v));
    expect_same(x, c.name);
    // And the sums Python's integers give, without the CPU in between.
    for (int threads : {1, 32}) {
      const std::vector<int64_t> l = gpu_limbs(x, threads, true);
      EXPECT_EQ(decimal(exact::unpack<4>(l.data() + 1, kL1)), c.s1) << c.name;
      EXPECT_EQ(decimal(exact::unpack<8>(l.data() + 1 + kL1, kL2)), c.s2) << c.name;
      EXPECT_EQ(l[0], c.bad) << c.name;
    }
  }
}

TEST(GpuExactAcc, NormalDataAroundOffsets) {
  std::mt19937_64 rng(5);
  for (double offset : {0.0, 1e4, 1e6, -3e7}) {
    std::normal_distribution<double> nd(offset, 1.5);
    for (size_t n : {1, 7, 100, 1000, 5000}) {
      std::vector<float> x(n);
      for (float& v : x) v = static_cast<float>(nd(rng));
      expect_same(x, "offset " + std::to_string(offset));
    }
  }
}

// Values far below the row's largest (slow path), subnormals, zeros, bad values.
TEST(GpuExactAcc, WideRangesSubnormalsZerosAndBadValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float tiny = std::numeric_limits<float>::denorm_min();
  std::vector<float> spread = {1e10f,     -3e-20f,         2.5f,   -1e-30f, 0.0f,     -0.0f, tiny,
                               -tiny * 7, 1.17549435e-38f, 6e-39f, 1.8e19f, -1.8e19f, 1e-5f};
  expect_same(spread, "spread over more than the window");
  std::vector<float> with_bad = spread;
  with_bad.insert(with_bad.end(), {inf, -inf, nan, 1.9e19f, -2e19f, 3.0f});
  expect_same(with_bad, "with bad values (inf, nan, |v| >= 2^64)");
  std::vector<float> zeros(100, 0.0f);
  zeros[17] = -0.0f;
  expect_same(zeros, "zeros only");
  expect_same({}, "no values");
  std::vector<float> subs;
  for (int i = 1; i < 300; ++i) subs.push_back((i % 2 ? 1 : -1) * tiny * static_cast<float>(i));
  expect_same(subs, "subnormals only");
  // Random exponents over the whole good range, a window's worth and far more.
  std::mt19937_64 rng(9);
  std::uniform_int_distribution<int> ex(-149, 63), mant(0, (1 << 24) - 1);
  std::vector<float> any(3000);
  for (float& v : any)
    v = static_cast<float>(std::ldexp(static_cast<double>(mant(rng)) / (1 << 24), ex(rng))) *
        (mant(rng) & 1 ? -1.0f : 1.0f);
  expect_same(any, "exponents over the whole range");
  // Squares truncated to the grid: tiny rows (the window stays at kSquareExactExp, every value
  // takes the direct path), and values across 2^-79 beside a larger one.
  std::vector<float> tinyrow(500), across;
  for (float& v : tinyrow)
    v = static_cast<float>(std::ldexp(static_cast<double>(mant(rng)) / (1 << 24), -100)) *
        (mant(rng) & 1 ? -1.0f : 1.0f);
  expect_same(tinyrow, "values around 2^-100 only");
  for (int e = -96; e < -60; ++e) across.push_back(std::ldexp(1.0f + e / 1000.0f, e));
  expect_same(across, "values across 2^-79 only");
  across.push_back(3.0f);
  expect_same(across, "values across 2^-79 and 3");
}

// More than kExactFlush values a thread, all at the top of the range: the fast sums must flush
// before they overflow (|sum M| < 2^62, sum M^2 < 2^110).
TEST(GpuExactAcc, FlushesBeforeOverflowAtTheTop) {
  const float top = std::nextafter(std::ldexp(1.0f, 64), 0.0f);  // (2^24 - 1) * 2^40
  const size_t n = 3 * kernels::cuda::kExactFlush + 123;
  std::vector<float> same(n, top);
  std::vector<float> mixed(n);
  for (size_t i = 0; i < n; ++i) mixed[i] = (i % 3 == 0 ? -1.0f : 1.0f) * top / (1 + i % 5);
  for (const auto* x : {&same, &mixed}) {
    for (bool squares : {true, false}) {
      const std::vector<int64_t> want = cpu_limbs(*x, squares);
      EXPECT_EQ(gpu_limbs(*x, 1, squares), want);  // one thread: n values between flushes
      EXPECT_EQ(gpu_limbs(*x, 2, squares), want);
    }
  }
}

// The kernels' row layout is the CPU's.
TEST(GpuExactRows, LimbLayoutAndPlanMatchTheCpu) {
  for (bool centered : {true, false})
    for (bool forward : {true, false})
      EXPECT_EQ(kernels::cuda::exact_row_limbs(centered, forward),
                kernels::cpu::exact_row_limbs(centered, forward));
  const auto warp = kernels::cuda::exact_row_plan(10, 1024, 4, {});
  EXPECT_EQ(warp.tpr, 32);
  EXPECT_EQ(warp.threads, 128);
  EXPECT_EQ(warp.blocks, 3);
  EXPECT_EQ(warp.vec, 4);
  const auto block = kernels::cuda::exact_row_plan(10, 1025, 2, {});
  EXPECT_EQ(block.tpr, 256);
  EXPECT_EQ(block.threads, 256);
  EXPECT_EQ(block.blocks, 10);
  EXPECT_EQ(block.vec, 1);
  EXPECT_EQ(kernels::cuda::exact_row_plan(0, 16, 4, {}).blocks, 0);
  EXPECT_EQ(kernels::cuda::exact_window_low(10), 1);
  EXPECT_EQ(kernels::cuda::exact_window_low(190), 166);
  EXPECT_EQ(kernels::cuda::exact_window_low(10, exact::kSquareExactExp), exact::kSquareExactExp);
  EXPECT_EQ(kernels::cuda::exact_window_low(190, exact::kSquareExactExp), 166);
}

}  // namespace
