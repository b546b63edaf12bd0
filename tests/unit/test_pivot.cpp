// The robust pivot (common/pivot.h): its rule (robust_pivot, and channel_pivot's choice of a
// SyncBatchNorm channel's values), and that it is the pivot the CPU row, group and channel
// kernels centre their forward sums on.
//
// A kernel's sum x reveals its pivot p exactly on crafted data: it comes back as
// p * n + sum float(x - p). On values [a, b, b, ...] with a = 2^-10 and b = 2^15 (exact in
// fp32, fp16 and bf16), a - p rounds in float32 by an amount that depends on p, while every
// d = x - p is a multiple of a power of two that float32 adds exactly in any order. So the
// kernel's sum x must equal, bit for bit, the one computed here from robust_pivot, and it
// differs from the one a pivot of x[0] would give (checked for each case).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/half.h"
#include "common/pivot.h"
#include "kernels/cpu/batch_norm.h"
#include "kernels/cpu/group_norm.h"
#include "kernels/cpu/row_norm.h"

using namespace tpnorm;
using tpnorm::detail::kPivotSpan;
using tpnorm::detail::robust_pivot;

namespace {

template <class T>
std::vector<T> stored(const std::vector<float>& v) {
  std::vector<T> out;
  for (float f : v) out.push_back(from_float<T>(f));
  return out;
}

// A crafted run of n values: a, then b; both scaled by 2^-scale (a different run per row or
// channel).
std::vector<float> crafted(int64_t n, int scale) {
  std::vector<float> v(static_cast<size_t>(n), std::ldexp(1.0f, 15 - scale));
  if (n > 0) v[0] = std::ldexp(1.0f, -10 - scale);
  return v;
}

// The sum x a kernel returns for values v summed around pivot p: p * n + sum float(x - p).
double pivoted_sum(const std::vector<float>& v, float p) {
  double d = 0;
  for (float x : v) d += static_cast<double>(x - p);
  return static_cast<double>(p) * static_cast<double>(v.size()) + d;
}

// Whether float32 adds the d = x - p of v exactly in any order: every d is a multiple of q
// (the smallest power of two any d is an odd multiple of) and sum |d| <= 2^24 q.
bool sums_exact(const std::vector<float>& v, float p) {
  double q = INFINITY, total = 0;
  for (float x : v) {
    const double d = static_cast<double>(x - p);
    total += std::fabs(d);
    if (d == 0) continue;
    int e;
    std::frexp(d, &e);
    while (std::fmod(d, std::ldexp(1.0, e)) != 0) --e;
    q = std::min(q, std::ldexp(1.0, e));
  }
  return total <= std::ldexp(q, 24);
}

// The kernel's sum x of v must be pivoted_sum(v, robust_pivot(v)), and v must tell that
// pivot from x[0].
void expect_pivot_from_rule(double kernel_sum, const std::vector<float>& v, const char* what) {
  const float p = robust_pivot(v.data(), static_cast<int64_t>(v.size()));
  ASSERT_TRUE(sums_exact(v, p)) << what << ": the crafted values do not sum exactly";
  if (v.size() > 1) {
    ASSERT_NE(pivoted_sum(v, p), pivoted_sum(v, v[0])) << what << ": cannot tell x[0] apart";
  }
  EXPECT_EQ(kernel_sum, pivoted_sum(v, p))
      << what << " (pivot " << p << ", x[0] would give " << pivoted_sum(v, v[0]) << ")";
}

// Lengths below, at and above the span.
const int64_t kLengths[] = {1, 8, 16, kPivotSpan, 100, 1000};

TEST(RobustPivot, MeanOfTheFirstSpanValues) {
  // v[i] = i for i < span, 1000 after: the pivot of n values is (min(n, span) - 1) / 2 exactly.
  for (int64_t n : {int64_t{1}, int64_t{2}, int64_t{7}, kPivotSpan - 1, kPivotSpan, kPivotSpan + 1,
                    int64_t{200}}) {
    std::vector<float> v;
    for (int64_t i = 0; i < n; ++i) v.push_back(i < kPivotSpan ? static_cast<float>(i) : 1000.0f);
    const float want = static_cast<float>(std::min(n, kPivotSpan) - 1) / 2;
    EXPECT_EQ(robust_pivot(v.data(), n), want) << "fp32 n=" << n;
    EXPECT_EQ(robust_pivot(stored<f16>(v).data(), n), want) << "fp16 n=" << n;
    EXPECT_EQ(robust_pivot(stored<bf16>(v).data(), n), want) << "bf16 n=" << n;
    // Strided (a channels-last channel): the values between are not read.
    for (int64_t stride : {2, 5}) {
      std::vector<float> s(static_cast<size_t>(n * stride), -500.0f);
      for (int64_t i = 0; i < n; ++i) s[i * stride] = v[i];
      EXPECT_EQ(robust_pivot(s.data(), n, stride), want) << "stride " << stride << " n=" << n;
      EXPECT_EQ(robust_pivot(stored<bf16>(s).data(), n, stride), want) << "bf16 stride " << stride;
    }
    // The accessor form (what device code calls with its own loads) is the same function.
    EXPECT_EQ(robust_pivot(n, [&](int64_t i) { return v[i]; }), want);
  }
}

TEST(RobustPivot, AccumulatesInDoubleAroundTheFirstValue) {
  // 1e4 + small: a float sum of the values would lose their fractions.
  std::vector<float> v;
  double sum = 0;
  for (int i = 0; i < 32; ++i) {
    v.push_back(10000.0f + 0.0078125f * static_cast<float>(i * i % 7));
    sum += v.back();
  }
  EXPECT_EQ(robust_pivot(v.data(), 32), static_cast<float>(sum / 32));
}

TEST(RobustPivot, SitsNearTheMeanWhenTheFirstValueIsAnOutlier) {
  // Rows of 1e4 + N(0,1) whose first value is 3 standard deviations out: the pivot must stay
  // within half a standard deviation of the row's mean (x[0] would be 3 away).
  std::mt19937_64 gen(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int row = 0; row < 16; ++row) {
    std::vector<float> v(4096);
    for (float& x : v) x = static_cast<float>(1e4 + normal(gen));
    v[0] = 1e4f + 3.0f;
    double mean = 0;
    for (float x : v) mean += x;
    mean /= static_cast<double>(v.size());
    EXPECT_LT(std::fabs(robust_pivot(v.data(), 4096) - mean), 0.5) << "row " << row;
  }
}

TEST(RobustPivot, ContiguousFloat32FormHasTheBitsOfTheRule) {
  // A contiguous fp32 run of kPivotSpan or more values takes a vector form on the host (where
  // the build has AVX): the same bits as the accessor form, which device code runs. Random
  // rows around offsets up to 1e6; with wide = true each value's scale is 2^k for a random k in
  // [-60, 60], so that the double sums round (an order of additions that differs shows only
  // where it moves the float result: a wrong value, lane or divisor shows on every row).
  std::mt19937_64 gen(5);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::uniform_int_distribution<int> k(-60, 60);
  int checked = 0;
  for (double offset : {0.0, 3.5, -1e4, 1e6})
    for (bool wide : {false, true})
      for (int64_t n : {kPivotSpan - 1, kPivotSpan, kPivotSpan + 3, int64_t{512}})
        for (int row = 0; row < 16; ++row) {
          std::vector<float> v(static_cast<size_t>(n));
          for (float& x : v)
            x = static_cast<float>(offset + std::ldexp(u(gen), wide ? k(gen) : 0));
          const float got = robust_pivot(v.data(), n);
          const float want = robust_pivot(n, [&](int64_t i) { return v[i]; });
          ASSERT_EQ(std::memcmp(&got, &want, sizeof got), 0)
              << "n=" << n << " offset " << offset << (wide ? " wide" : "") << ": " << got
              << " vs " << want;
          ++checked;
        }
  EXPECT_EQ(checked, 4 * 2 * 4 * 16);
}

TEST(RobustPivot, NoValues) {
  const float* none = nullptr;
  EXPECT_EQ(robust_pivot(none, 0), 0.0f);
  EXPECT_EQ(robust_pivot(none, 0, 7), 0.0f);
}

TEST(RobustPivot, ChannelPivotReadsTheChannelsFirstValues) {
  // Distinct values everywhere: a pivot over the wrong elements (stride, plane) shows.
  const int64_t c = 3;
  for (bool channels_last : {false, true})
    for (int64_t n : {0, 1, 3})
      for (int64_t inner : {0, 1, 5, 40}) {
        std::vector<float> x(static_cast<size_t>(n * c * inner));
        for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 37) % 101);
        for (int64_t ch = 0; ch < c; ++ch) {
          // NCHW: sample 0's plane of the channel; channels-last: every position, in order.
          std::vector<float> own;
          for (int64_t b = 0; b < (channels_last ? n : std::min<int64_t>(n, 1)); ++b)
            for (int64_t s = 0; s < inner; ++s)
              own.push_back(x[channels_last ? (b * inner + s) * c + ch : (b * c + ch) * inner + s]);
          const float want = robust_pivot(own.data(), static_cast<int64_t>(own.size()));
          const float* data = x.empty() ? nullptr : x.data();  // empty: nothing may be read
          EXPECT_EQ(detail::channel_pivot(data, n, c, inner, channels_last, ch), want)
              << (channels_last ? "channels-last" : "NCHW") << " n=" << n << " inner=" << inner
              << " ch=" << ch;
          EXPECT_EQ(detail::channel_pivot(stored<bf16>(x).data(), n, c, inner, channels_last, ch),
                    robust_pivot(stored<bf16>(own).data(), static_cast<int64_t>(own.size())));
        }
      }
}

template <class T>
class KernelsPivot : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, f16, bf16>;
TYPED_TEST_SUITE(KernelsPivot, StorageTypes);

TYPED_TEST(KernelsPivot, RowsAndGroupPlanes) {
  using T = TypeParam;
  for (int64_t h : kLengths) {
    const int64_t rows = 3;
    std::vector<float> all;
    for (int r = 0; r < rows; ++r) {
      const auto v = crafted(h, r);
      all.insert(all.end(), v.begin(), v.end());
    }
    const auto x = stored<T>(all);
    std::vector<double> st(static_cast<size_t>(2 * rows));
    kernels::cpu::row_partial_forward<T, double>({rows, h, true, 2}, x.data(), st.data());
    for (int r = 0; r < rows; ++r)
      expect_pivot_from_rule(st[2 * r], crafted(h, r), ("row, h=" + std::to_string(h)).c_str());

    // GroupNorm: 1 sample, 3 channels in one group; planes added in order.
    std::vector<double> gs(2, 0.0);
    kernels::cpu::group_partial_forward<T, double>({1, rows, h, 0, 1, rows, 2}, x.data(),
                                                   gs.data());
    double want = 0;
    for (int r = 0; r < rows; ++r) {
      const auto v = crafted(h, r);
      want += pivoted_sum(v, robust_pivot(v.data(), h));
    }
    EXPECT_EQ(gs[0], want) << "group, spatial=" << h;
  }
}

TYPED_TEST(KernelsPivot, BatchNormChannels) {
  using T = TypeParam;
  const int64_t c = 3;
  for (bool channels_last : {false, true})
    for (int64_t n : {1, 4})
      for (int64_t inner : kLengths) {
        const int64_t m = n * inner;  // values per channel
        // Channel ch's values in its order (sample, position): crafted(m, ch).
        std::vector<float> all(static_cast<size_t>(m * c));
        for (int64_t ch = 0; ch < c; ++ch) {
          const auto v = crafted(m, static_cast<int>(ch));
          for (int64_t b = 0; b < n; ++b)
            for (int64_t s = 0; s < inner; ++s)
              all[channels_last ? (b * inner + s) * c + ch : (b * c + ch) * inner + s] =
                  v[b * inner + s];
        }
        const auto x = stored<T>(all);
        std::vector<double> st(static_cast<size_t>(2 * c));
        kernels::cpu::BatchNormArgs a;
        a.n = n;
        a.c = c;
        a.inner = inner;
        a.channels_last = channels_last;
        a.threads = 2;
        kernels::cpu::bn_partial_forward<T, double>(a, x.data(), st.data());
        for (int64_t ch = 0; ch < c; ++ch) {
          const auto v = crafted(m, static_cast<int>(ch));
          // NCHW pivots on sample 0's plane of the channel, channels-last on its first values.
          const std::vector<float> first(v.begin(), v.begin() + (channels_last ? m : inner));
          const float p = robust_pivot(first.data(), static_cast<int64_t>(first.size()));
          const std::string what = std::string(channels_last ? "channels-last" : "NCHW") +
                                   " n=" + std::to_string(n) + " inner=" + std::to_string(inner) +
                                   " ch=" + std::to_string(ch);
          ASSERT_TRUE(sums_exact(v, p)) << what;
          if (first.size() > 1) {
            ASSERT_NE(pivoted_sum(v, p), pivoted_sum(v, v[0])) << what;
          }
          EXPECT_EQ(st[2 * ch], pivoted_sum(v, p)) << what;
        }
      }
}

}  // namespace
