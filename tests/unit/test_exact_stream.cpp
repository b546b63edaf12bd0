// The exact mode's fast paths against its slow ones, on inputs chosen to break them:
// ExactStream (kernels/cpu/exact_bins.h: one pass, the exponent window chosen on the fly)
// against ExactBins (one bin per exponent); the row kernels' one-pass sums (exact_rows.h)
// against ExactBins over the same values or terms; exact::ratio (one 128-by-64-bit division)
// against long division over every word; SyncBatchNorm's channel kernels (exact_channels.h:
// a stream per channel, or one lane per channel) against ExactBins per channel. Exact integers have
// one right answer, so every comparison is for equality.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/exact_sum.h"
#include "kernels/cpu/exact_bins.h"
#include "kernels/cpu/exact_channels.h"
#include "kernels/cpu/exact_rows.h"
#include "kernels/cpu/loops.h"

namespace {

using namespace tpnorm;
using kernels::cpu::ExactBins;
using kernels::cpu::ExactStream;
using kernels::cpu::vf;

constexpr float kInf = std::numeric_limits<float>::infinity();
const float kTop = std::nextafter(std::ldexp(1.0f, exact::kMaxExp), 0.0f);  // largest good value

struct Sums {
  exact::Sum1 s1;
  exact::Sum2 s2;
  int64_t bad = 0;
  bool operator==(const Sums& o) const { return s1 == o.s1 && s2 == o.s2 && bad == o.bad; }
};

Sums by_bins(const std::vector<float>& v) {
  ExactBins bins;
  bins.add_values_and_squares(static_cast<int64_t>(v.size()), [&](int64_t j) { return v[j]; });
  return {bins.sum(), bins.sum_of_squares(), bins.bad()};
}

// v through ExactStream, as vectors and then pieces of `tail` (< vf::L) values at a time, so
// that add_partial's padding sits between full vectors too.
template <bool kSquares>
Sums by_stream(const std::vector<float>& v, int tail) {
  Sums s;
  ExactStream<kSquares> stream(s.s1, kSquares ? &s.s2 : nullptr, s.bad);
  size_t j = 0;
  int turn = 0;
  while (j < v.size()) {
    const size_t left = v.size() - j;
    if (left < static_cast<size_t>(vf::L) || (tail > 0 && ++turn % 3 == 0)) {
      const int n = static_cast<int>(std::min<size_t>(left, tail > 0 ? tail : left));
      stream.add_partial(v.data() + j, n);
      j += n;
    } else {
      stream.add(kernels::cpu::vload(v.data() + j));
      j += vf::L;
    }
  }
  stream.finish();
  return s;
}

std::string describe(const exact::Sum1& a) {
  std::string s;
  for (int i = 3; i >= 0; --i) s += std::to_string(a.w[i]) + " ";
  return s;
}

// Inputs named by what they aim at.
std::vector<std::pair<std::string, std::vector<float>>> adversarial_inputs() {
  std::vector<std::pair<std::string, std::vector<float>>> in;
  std::mt19937_64 rng(15);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto add = [&](const std::string& name, std::vector<float> v) { in.emplace_back(name, v); };

  std::vector<float> v;
  for (int i = 0; i < 300; ++i) v.push_back(std::ldexp(normal(rng), -140));
  add("subnormals only", v);
  v.clear();
  for (int i = 0; i < 300; ++i)
    v.push_back(i % 2 ? std::ldexp(normal(rng), -135) : std::ldexp(normal(rng), -110));
  add("subnormals beside small normals", v);
  v.clear();
  for (int i = 0; i < 500; ++i) {
    const int k = static_cast<int>(rng() % 4);
    v.push_back(k == 0 ? kTop : k == 1 ? -kTop : k == 2 ? 1e-30f : std::ldexp(1.0f, -149));
  }
  add("huge and tiny mixed", v);
  v.clear();
  for (int i = 0; i < 700; ++i) {
    const float x = std::ldexp(normal(rng), static_cast<int>(rng() % 60));
    v.push_back(x);
    v.push_back(-x);
  }
  v.push_back(std::ldexp(1.0f, -149));
  add("cancellation to one subnormal", v);
  v.assign(1000, 1e6f);
  for (float& x : v) x += normal(rng);
  add("offset 1e6", v);
  v.clear();
  for (float x : {kTop, -kTop, std::ldexp(1.0f, 64), -std::ldexp(1.0f, 64), std::ldexp(1.0f, 63)})
    v.insert(v.end(), 37, x);
  add("exponents at the limit 2^64 (2^64 itself is bad)", v);
  v.clear();
  for (int i = 0; i < 200; ++i) v.push_back(normal(rng));
  v[3] = std::numeric_limits<float>::quiet_NaN();
  v[40] = kInf;
  v[41] = -kInf;
  v[199] = std::numeric_limits<float>::quiet_NaN();
  add("NaN and inf among normals", v);
  v.clear();
  for (int e = -149; e < 64; ++e)
    for (int r = 0; r < 5; ++r) v.push_back(std::ldexp(1.0f + 0.25f * normal(rng), e));
  add("rising exponents (the window reopens again and again)", v);
  std::reverse(v.begin(), v.end());
  add("falling exponents (most values below the window)", v);
  v.assign(64, 0.0f);
  v.push_back(-0.0f);
  for (int i = 0; i < 100; ++i) v.push_back(normal(rng));
  add("zeros first (the window opens late)", v);
  v.clear();
  for (int i = 0; i < 3000; ++i) {
    const int e = static_cast<int>(rng() % 214) - 150;  // every exponent, subnormals to 2^63
    v.push_back(std::ldexp(normal(rng), e));
  }
  add("exponents uniform over the range", v);
  // The largest M the lanes take (|M| just below 2^51: 24-bit significand at the window's top)
  // for more adds than a flush holds, to exercise the headroom of the sums and the squares.
  v.assign(16, std::ldexp(1.0f, 10));  // opens ehi = 10 + 127 + kSlack
  for (int i = 0; i < 40000; ++i)
    v.push_back((i % 3 ? 1.0f : -1.0f) * std::nextafter(std::ldexp(1.0f, 14), 0.0f));
  add("largest M in every lane past the flush count", v);
  v.assign(40000, -kTop);
  add("largest good value, 40000 times", v);
  v.clear();
  for (int i = 0; i < 5000; ++i) v.push_back(rng() % 9 == 0 ? 0.0f : normal(rng));
  add("N(0,1) with zeros", v);
  // Squares truncated to the grid (|v| < 2^-79, exact_sum.h): the squares stream keeps its
  // window above them and sends them, one by one, to exact_add_one.
  v.clear();
  for (int i = 0; i < 1000; ++i) v.push_back(std::ldexp(normal(rng), -100));
  add("tiny values around 2^-100 only (every square truncated)", v);
  v.clear();
  for (int e = -95; e < -60; ++e)
    for (int r = 0; r < 7; ++r) v.push_back(std::ldexp(1.0f + 0.25f * normal(rng), e));
  add("exponents across 2^-79, where squares stop being exact", v);
  v.clear();
  for (int i = 0; i < 2000; ++i)
    v.push_back(i % 5 ? std::ldexp(normal(rng), -60 - static_cast<int>(rng() % 80)) : normal(rng));
  add("normal values among tiny ones (tiny ones below the window)", v);
  return in;
}

// ExactStream gives the integers of ExactBins, with squares and without, at every tail length.
TEST(ExactStream, MatchesBinsOnAdversarialInputs) {
  for (const auto& [name, v] : adversarial_inputs()) {
    SCOPED_TRACE(name);
    const Sums want = by_bins(v);
    for (int tail : {0, 1, 7, vf::L - 1}) {
      SCOPED_TRACE("tail " + std::to_string(tail));
      const Sums got = by_stream<true>(v, tail);
      EXPECT_TRUE(got.s1 == want.s1) << describe(got.s1) << "vs " << describe(want.s1);
      EXPECT_TRUE(got.s2 == want.s2);
      EXPECT_EQ(got.bad, want.bad);
      const Sums one = by_stream<false>(v, tail);
      EXPECT_TRUE(one.s1 == want.s1) << describe(one.s1) << "vs " << describe(want.s1);
      EXPECT_EQ(one.bad, want.bad);
    }
  }
}

// Streams over any parts of the values, in any order, add up to the same integers.
TEST(ExactStream, PartsAddUp) {
  for (const auto& [name, v] : adversarial_inputs()) {
    SCOPED_TRACE(name);
    const Sums want = by_bins(v);
    std::mt19937_64 rng(3);
    for (int trial = 0; trial < 3; ++trial) {
      std::vector<float> w = v;
      std::shuffle(w.begin(), w.end(), rng);
      Sums total;
      size_t at = 0;
      while (at < w.size()) {
        const size_t n = std::min<size_t>(w.size() - at, 1 + rng() % 5000);
        const Sums part =
            by_stream<true>(std::vector<float>(w.begin() + at, w.begin() + at + n), 5);
        exact::add(total.s1, part.s1);
        exact::add(total.s2, part.s2);
        total.bad += part.bad;
        at += n;
      }
      EXPECT_TRUE(total == want);
    }
  }
}

// The row kernels' one-pass sums, through the final statistics of a row at one rank, equal the
// statistics of ExactBins' integers over the same values (forward) or the same terms formed
// one at a time (backward), at row lengths with every tail.
TEST(ExactStream, RowKernelsMatchBins) {
  std::mt19937_64 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto inputs = adversarial_inputs();
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::vector<float>& x = inputs[i].second;
    for (int64_t h : {int64_t{1}, int64_t{17}, int64_t{100}, static_cast<int64_t>(x.size())}) {
      if (h > static_cast<int64_t>(x.size())) continue;
      SCOPED_TRACE(inputs[i].first + ", h " + std::to_string(h));
      const std::vector<float> row(x.begin(), x.begin() + h);
      const Sums want = by_bins(row);
      const auto n = static_cast<uint64_t>(h);
      const double nan = std::numeric_limits<double>::quiet_NaN();
      double st[2];
      kernels::cpu::exact_row_final_forward(true, row.data(), h, st);
      const double mean = want.bad ? nan : exact::mean(want.s1, n);
      const double var = want.bad ? nan : exact::variance(want.s1, want.s2, n);
      EXPECT_EQ(std::isnan(st[0]), std::isnan(mean));
      if (!std::isnan(mean)) {
        EXPECT_EQ(st[0], mean);
        EXPECT_EQ(st[1], var);
      }
      kernels::cpu::exact_row_final_forward(false, row.data(), h, st);
      if (!want.bad) {
        EXPECT_EQ(st[0], exact::mean_square(want.s2, n));
      }

      // Backward: g = dy * gamma and g * xhat, xhat = ((x - mh) - mt) * rs, term by term.
      std::vector<float> dy(h), gamma(h), g(h), gx(h);
      for (int64_t j = 0; j < h; ++j) dy[j] = normal(rng), gamma[j] = 1.0f + 0.1f * normal(rng);
      const float mh = 0.75f, mt = 1e-9f, rs = 1.5f;
      for (int64_t j = 0; j < h; ++j) {
        const float xhat = ((row[j] - mh) - mt) * rs;
        g[j] = dy[j] * gamma[j];
        gx[j] = g[j] * xhat;
      }
      const Sums sg = by_bins(g), sgx = by_bins(gx);
      kernels::cpu::exact_row_final_backward(true, dy.data(), row.data(), gamma.data(), mh, mt, rs,
                                             h, st);
      const bool bad = sg.bad + sgx.bad != 0;
      EXPECT_EQ(std::isnan(st[0]), bad);
      if (!bad) {
        EXPECT_EQ(st[0], exact::mean(sg.s1, n));
        EXPECT_EQ(st[1], exact::mean(sgx.s1, n));
      }
    }
  }
}

// SyncBatchNorm's exact partials in every layout (NCHW planes, [N, C] and channels-last rows
// with a lane per channel, channel counts that leave a partial vector, 1-2 threads) give each
// channel's integers as ExactBins makes them from its values (forward: x; backward: dy and
// dy * ((x - head) - tail)), on channels of different scales (some of values under 2^-79, whose
// squares are truncated), subnormals, huge values and NaN.
TEST(ExactStream, ChannelKernelsMatchBins) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t c : {1, 5, 16, 21, 64}) {
    for (int64_t inner : {1, 7, 16, 50}) {
      for (bool last : {false, true}) {
        for (int threads : {1, 2}) {
          SCOPED_TRACE("c " + std::to_string(c) + " inner " + std::to_string(inner) +
                       (last ? " channels-last" : " NCHW") + " threads " + std::to_string(threads));
          kernels::cpu::BatchNormArgs a;
          a.n = 3;
          a.c = c;
          a.inner = inner;
          a.channels_last = last;
          a.threads = threads;
          const int64_t total = a.n * c * inner;
          std::vector<float> x(total), dy(total);
          std::vector<double> mean(c);
          auto at = [&](int64_t ch, int64_t i) {  // element i of channel ch
            const int64_t b = i / inner, s = i % inner;
            return last ? (b * inner + s) * c + ch : (b * c + ch) * inner + s;
          };
          for (int64_t ch = 0; ch < c; ++ch) {
            // Channels far apart; every fifth at 2^-140..2^-61, where squares are truncated.
            const int scale = static_cast<int>(rng() % 80) - (ch % 5 == 4 ? 140 : 40);
            mean[ch] = std::ldexp(0.5, scale);
            for (int64_t i = 0; i < a.n * inner; ++i) {
              float v = std::ldexp(normal(rng), scale);
              if (rng() % 17 == 0) v = std::ldexp(normal(rng), -140);        // subnormal
              if (rng() % 23 == 0) v = std::ldexp(normal(rng), scale - 40);  // below the window
              if (rng() % 29 == 0) v = std::ldexp(normal(rng), 60);          // above it
              x[at(ch, i)] = v;
              dy[at(ch, i)] = normal(rng);
            }
          }
          if (c > 3) x[at(3, 0)] = std::numeric_limits<float>::quiet_NaN();
          const int kf = exact::moment_limbs(true), kb = exact::moment_limbs(false);
          std::vector<int64_t> got_f(c * kf), got_b(c * kb);
          kernels::cpu::bn_exact_partial_forward(a, x.data(), got_f.data());
          kernels::cpu::bn_exact_partial_backward(a, dy.data(), x.data(), mean.data(),
                                                  got_b.data());
          for (int64_t ch = 0; ch < c; ++ch) {
            std::vector<float> v, d, dxmu;
            float mh, mt;
            kernels::cpu::split_mean(mean[ch], mh, mt);
            for (int64_t i = 0; i < a.n * inner; ++i) {
              const float xi = x[at(ch, i)], di = dy[at(ch, i)];
              v.push_back(xi);
              d.push_back(di);
              dxmu.push_back(di * ((xi - mh) - mt));
            }
            const Sums fw = by_bins(v), s1 = by_bins(d), s2 = by_bins(dxmu);
            std::vector<int64_t> want_f(kf), want_b(kb);
            want_f[0] = fw.bad;
            exact::pack(fw.s1, want_f.data() + 1, exact::kLimbs1);
            exact::pack(fw.s2, want_f.data() + 1 + exact::kLimbs1, exact::kLimbs2);
            want_b[0] = s1.bad + s2.bad;
            exact::pack(s1.s1, want_b.data() + 1, exact::kLimbs1);
            exact::pack(s2.s1, want_b.data() + 1 + exact::kLimbs1, exact::kLimbs1);
            for (int k = 0; k < kf; ++k) ASSERT_EQ(got_f[ch * kf + k], want_f[k]) << ch << " " << k;
            for (int k = 0; k < kb; ++k) ASSERT_EQ(got_b[ch * kb + k], want_b[k]) << ch << " " << k;
          }
        }
      }
    }
  }
}

// The ratio before it took one division: long division over every word (the reference).
template <int W>
double ratio_by_long_division(const exact::Wide<W>& num, uint64_t den, int exp2) {
  exact::Wide<W + 3> a = exact::widen<W + 3>(num);
  const int b = exact::bit_length(a);
  if (b == 0) return 0.0;
  const int s = b < 128 ? 128 - b : 0;
  a = exact::shifted_left(a, s);
  const uint64_t rem = exact::divide(a, den);
  const int t = exact::bit_length(a) - 53;
  uint64_t mant = exact::bits_at(a, t, 53);
  const bool half = exact::bits_at(a, t - 1, 1) != 0;
  const bool rest = rem != 0 || exact::any_below(a, t - 1);
  if (half && (rest || (mant & 1))) ++mant;
  return std::ldexp(static_cast<double>(mant), t + exp2 - s);
}

// Random numerators of every length (and ones built to sit on a tie or just off it) over
// divisors 1, powers of two, small, and up to 2^64 - 1.
TEST(ExactStream, RatioMatchesLongDivision) {
  std::mt19937_64 rng(21);
  int checked = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    exact::Wide<8> num;
    const int bits = 1 + static_cast<int>(rng() % 500);
    for (int i = 0; i < 8; ++i) num.w[i] = rng();
    for (int i = 0; i < 8; ++i) {
      const int lo = 64 * i;
      if (lo >= bits)
        num.w[i] = 0;
      else if (bits - lo < 64)
        num.w[i] &= (uint64_t{1} << (bits - lo)) - 1;
    }
    const bool tie = trial % 4 == 1 || trial % 4 == 2;
    if (tie) {  // 54 significant bits, the last one set, then zeros: a tie over a power of two
      const uint64_t m = (rng() >> 10) | (uint64_t{1} << 53) | 1;
      num = exact::shifted_left(exact::Wide<8>{{m}}, static_cast<int>(rng() % 400));
      // ... or just above one, by a unit far below the top 128 bits.
      if (trial % 4 == 2) exact::add_shifted(num, 1, 0);
    }
    const uint64_t kinds[] = {1, uint64_t{1} << (rng() % 64), 1 + rng() % 1000, rng() | 1,
                              ~uint64_t{0}};
    const uint64_t den = kinds[tie ? trial % 2 : trial % 5];
    const int exp2 = static_cast<int>(rng() % 600) - 300;
    const double want = ratio_by_long_division(num, den, exp2);
    const double got = exact::ratio(num, den, exp2);
    ASSERT_EQ(got, want) << "trial " << trial << " den " << den;
    ++checked;
  }
  EXPECT_EQ(checked, 20000);
}

}  // namespace
