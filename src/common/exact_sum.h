// exact_sum.h — exact fixed-point sums, the statistics of Stats::kExact.
//
// Why: a float sum depends on how a row is split across ranks and in which order the pieces
// are added; an integer sum does not. Every rank turns its partial sums into integers on ONE
// grid that every rank knows without communicating, the ranks add the integers (one int64
// all-reduce), and mean and variance come out of the integers, each rounded once.
//
// The grid, the same for every storage dtype (fp32, bf16 and fp16 values all lie on it):
//   values   v = k * 2^-149 (fp32's smallest subnormal) with |v| < 2^64   (kValueLsb, kMaxExp)
//   squares  on the grid 2^-204, each square truncated to it BEFORE it is added (kSquareLsb)
// Every finite value with |v| < 2^64, subnormals included, is on the value grid: sums of values
// are never rounded. A square v^2 = m^2 * 2^(2e-300) (m the 24-bit significand, e the biased
// exponent) is on the square grid when e >= kSquareExactExp = 48, i.e. |v| >= 2^-79; below
// that it is truncated toward zero to a multiple of 2^-204, losing less than 2^-204 (values
// under 2^-102 square to 0). The truncation is a function of the element alone, so the integers
// are still the same whatever the split or the order: bitwise invariance holds for every
// input. The statistics are then those of the truncated squares: the mean square and the
// variance are low by less than 2^-204 absolute (the variance never below 0): next to eps in
// 1/sqrt(var + eps) a relative change under 2^-204 / eps (2^-164 at eps = 1e-12), where float
// outputs have 2^-24. It matters only at eps = 0 on a row whose values are all under ~2^-79:
// e.g. values ±2^-110 get variance 0 and rstd = inf (the exact variance would be 2^-220).
// Why not 2^-298, where every fp32 square lies: its sums need 9 limbs, these 7 (RMSNorm
// forward: 8 int64 a row against kRobust's one float64, the 8x the mode allows). A value that is
// not finite or has |v| >= 2^64 is counted as "bad" and left out of the sums; the ops make the
// statistics of such a row NaN, as a float sum of it would be.
//
// Sizes, with n < 2^32 values a statistic over all ranks (kMaxCount):
//   sum v    |.| < 2^(64+149+32) = 2^245 units of 2^-149   -> Sum1 = Wide<4> (256-bit signed)
//   sum v^2   0 <= . < 2^(128+204+32) = 2^364 units of 2^-204 -> Sum2 = Wide<8> (512-bit: the
//            width variance() needs for n * sum v^2 * 2^94 on the grid of (sum v)^2, < 2^490)
// On the wire a sum is split into limbs of kLimbBits = 52 bits: every limb but the top one in
// [0, 2^52), the top one signed and bounded by the TOTAL over ranks (a rank's top limb is its
// sum shifted down, and those add to at most the total's): |top| < 2^37 for Sum1, < 2^52 for
// Sum2, far from 2^63. The lower limbs bound the ranks: kMaxRanks = 2048 ranks add limbs below
// 2^52 without overflowing int64 (2048 * (2^52 - 1) < 2^63). unpack() adds the limbs back with
// their carries, so any split of the values over ranks, in any order, gives the same integers.
//   Sum1: kLimbs1 = 5 limbs (40 bytes)      Sum2: kLimbs2 = 7 limbs (56 bytes)
// Payload per row (int64s, with `bad`): RMSNorm forward 1 + 7 = 8 (8x kRobust's one float64),
// LayerNorm 1 + 5 + 7 = 13 (6.5x); backward RMSNorm 1 + 5 = 6, LayerNorm 1 + 5 + 5 = 11 (against
// two float64s); SyncBatchNorm and GroupNorm per channel / slot: moment_limbs() = 13 forward,
// 11 backward.
//
// Host and device: everything here is TPNORM_HD and uses only 64/128-bit integer arithmetic.
#pragma once

#include <cmath>
#include <cstdint>

#if __has_include("common/host_device.h")
#include "common/host_device.h"
#endif
#ifndef TPNORM_HD
#if defined(__CUDACC__)
#define TPNORM_HD __host__ __device__
#else
#define TPNORM_HD
#endif
#endif

namespace tpnorm::exact {

constexpr int kValueLsb = -149;   ///< sums of values count units of 2^-149
constexpr int kSquareLsb = -204;  ///< sums of squares count units of 2^-204
constexpr int kMaxExp = 64;       ///< values need |v| < 2^kMaxExp
constexpr int kLimbBits = 52;     ///< payload bits per int64 limb below the top one
constexpr int kLimbs1 = 5;        ///< limbs of a sum of values
constexpr int kLimbs2 = 7;        ///< limbs of a sum of squares
/// The smallest biased exponent whose squares lie on the square grid (|v| >= 2^-79).
constexpr int kSquareExactExp = (300 + kSquareLsb) / 2;
static_assert(2 * kSquareExactExp == 300 + kSquareLsb, "an exponent whose squares are exact");
static_assert(kLimbBits * (kLimbs2 - 1) + 52 >= 128 + 32 - kSquareLsb, "sum of squares fits");
constexpr int kMaxRanks = 2048;             ///< P * (2^52 - 1) < 2^63
constexpr double kMaxCount = 4294967296.0;  ///< n < 2^32 values per statistic

/// int64 limbs per statistic of the SyncBatchNorm and GroupNorm payloads (their channels and
/// slots share one layout), `bad` first: forward {bad, sum x, sum x^2}, backward {bad, sum a,
/// sum b} (two sums of values).
TPNORM_HD constexpr int moment_limbs(bool forward) {
  return 1 + kLimbs1 + (forward ? kLimbs2 : kLimbs1);
}

/// A W-word two's-complement integer, little-endian 64-bit words.
template <int W>
struct Wide {
  uint64_t w[W] = {};
};
using Sum1 = Wide<4>;  ///< sum of values, units of 2^kValueLsb
using Sum2 = Wide<8>;  ///< sum of squares, units of 2^kSquareLsb

/// The square of a value ±m * 2^(e-150) (m < 2^24 its significand, e >= 1 its biased
/// exponent, subnormals as 1) on the square grid is square_units(m, e) * 2^square_shift(e)
/// units of 2^kSquareLsb: m^2 shifted up when the square is on the grid (e >= kSquareExactExp),
/// otherwise truncated toward zero to the grid (shift 0). Every accumulator adds squares
/// through these two, so every split of the values gives the same integers.
TPNORM_HD constexpr int square_shift(int e) {
  return 2 * e >= 300 + kSquareLsb ? 2 * e - 300 - kSquareLsb : 0;
}
TPNORM_HD constexpr uint64_t square_units(uint64_t m, int e) {
  return 2 * e >= 300 + kSquareLsb        ? m * m
         : 300 + kSquareLsb - 2 * e >= 48 ? 0  // m^2 < 2^48: nothing left on the grid
                                          : (m * m) >> (300 + kSquareLsb - 2 * e);
}

using u128 = unsigned __int128;

template <int W>
TPNORM_HD inline bool is_negative(const Wide<W>& a) {
  return (a.w[W - 1] >> 63) != 0;
}

template <int W>
TPNORM_HD inline bool is_zero(const Wide<W>& a) {
  uint64_t o = 0;
  for (int i = 0; i < W; ++i) o |= a.w[i];
  return o == 0;
}

template <int W>
TPNORM_HD inline bool operator==(const Wide<W>& a, const Wide<W>& b) {
  for (int i = 0; i < W; ++i)
    if (a.w[i] != b.w[i]) return false;
  return true;
}

/// a += b (mod 2^(64W)).
template <int W>
TPNORM_HD inline void add(Wide<W>& a, const Wide<W>& b) {
  uint64_t carry = 0;
  for (int i = 0; i < W; ++i) {
    const u128 s = static_cast<u128>(a.w[i]) + b.w[i] + carry;
    a.w[i] = static_cast<uint64_t>(s);
    carry = static_cast<uint64_t>(s >> 64);
  }
}

template <int W>
TPNORM_HD inline Wide<W> negated(const Wide<W>& a) {
  Wide<W> r;
  uint64_t carry = 1;
  for (int i = 0; i < W; ++i) {
    const u128 s = static_cast<u128>(~a.w[i]) + carry;
    r.w[i] = static_cast<uint64_t>(s);
    carry = static_cast<uint64_t>(s >> 64);
  }
  return r;
}

template <int W>
TPNORM_HD inline Wide<W> magnitude(const Wide<W>& a) {
  return is_negative(a) ? negated(a) : a;
}

/// a += v * 2^shift (0 <= shift, v * 2^shift within the width).
template <int W>
TPNORM_HD inline void add_shifted(Wide<W>& a, int64_t v, int shift) {
  const int k = shift >> 6, b = shift & 63;
  const __int128 t = static_cast<__int128>(v) * (static_cast<__int128>(1) << b);
  const uint64_t ext = v < 0 ? ~uint64_t{0} : 0;  // sign extension above the two words
  uint64_t carry = 0;
  for (int i = k; i < W; ++i) {
    const uint64_t part = i == k       ? static_cast<uint64_t>(t)
                          : i == k + 1 ? static_cast<uint64_t>(static_cast<u128>(t) >> 64)
                                       : ext;
    const u128 s = static_cast<u128>(a.w[i]) + part + carry;
    a.w[i] = static_cast<uint64_t>(s);
    carry = static_cast<uint64_t>(s >> 64);
  }
}

/// a += v * 2^shift for unsigned v (0 <= shift, within the width).
template <int W>
TPNORM_HD inline void add_shifted_unsigned(Wide<W>& a, uint64_t v, int shift) {
  const int k = shift >> 6, b = shift & 63;
  const u128 t = static_cast<u128>(v) << b;
  uint64_t carry = 0;
  for (int i = k; i < W; ++i) {
    const uint64_t part = i == k       ? static_cast<uint64_t>(t)
                          : i == k + 1 ? static_cast<uint64_t>(t >> 64)
                                       : 0;
    if (i > k + 1 && carry == 0) break;
    const u128 s = static_cast<u128>(a.w[i]) + part + carry;
    a.w[i] = static_cast<uint64_t>(s);
    carry = static_cast<uint64_t>(s >> 64);
  }
}

/// a += b * 2^shift for b >= 0 (within the width).
template <int W, int V>
TPNORM_HD inline void add_shifted_wide(Wide<W>& a, const Wide<V>& b, int shift);

/// a sign-extended (or truncated) to W2 words.
template <int W2, int W>
TPNORM_HD inline Wide<W2> widen(const Wide<W>& a) {
  Wide<W2> r;
  const uint64_t ext = is_negative(a) ? ~uint64_t{0} : 0;
  for (int i = 0; i < W2; ++i) r.w[i] = i < W ? a.w[i] : ext;
  return r;
}

/// a * m for a >= 0 (mod 2^(64W)).
template <int W>
TPNORM_HD inline Wide<W> times(const Wide<W>& a, uint64_t m) {
  Wide<W> r;
  uint64_t carry = 0;
  for (int i = 0; i < W; ++i) {
    const u128 p = static_cast<u128>(a.w[i]) * m + carry;
    r.w[i] = static_cast<uint64_t>(p);
    carry = static_cast<uint64_t>(p >> 64);
  }
  return r;
}

/// a * b for a, b >= 0, into 2W words.
template <int W>
TPNORM_HD inline Wide<2 * W> product(const Wide<W>& a, const Wide<W>& b) {
  Wide<2 * W> r;
  for (int i = 0; i < W; ++i) {
    uint64_t carry = 0;
    for (int j = 0; j < W; ++j) {
      const u128 p = static_cast<u128>(a.w[i]) * b.w[j] + r.w[i + j] + carry;
      r.w[i + j] = static_cast<uint64_t>(p);
      carry = static_cast<uint64_t>(p >> 64);
    }
    r.w[i + W] = carry;
  }
  return r;
}

/// Bits of v (0 for v == 0).
TPNORM_HD inline int bit_length64(uint64_t v) {
#if defined(__CUDA_ARCH__)
  return 64 - __clzll(static_cast<long long>(v));
#else
  return v ? 64 - __builtin_clzll(v) : 0;
#endif
}

/// Bits of a >= 0 (0 for a == 0).
template <int W>
TPNORM_HD inline int bit_length(const Wide<W>& a) {
  for (int i = W - 1; i >= 0; --i)
    if (a.w[i]) return 64 * i + bit_length64(a.w[i]);
  return 0;
}

/// a * 2^s for a >= 0, 0 <= s (bits shifted past the top are lost).
template <int W>
TPNORM_HD inline Wide<W> shifted_left(const Wide<W>& a, int s) {
  Wide<W> r;
  const int k = s >> 6, b = s & 63;
  for (int i = W - 1; i >= k; --i) {
    uint64_t v = a.w[i - k] << b;
    if (b && i - k - 1 >= 0) v |= a.w[i - k - 1] >> (64 - b);
    r.w[i] = v;
  }
  return r;
}

template <int W, int V>
TPNORM_HD inline void add_shifted_wide(Wide<W>& a, const Wide<V>& b, int shift) {
  add(a, shifted_left(widen<W>(b), shift));
}

/// `count` (<= 64) bits of a >= 0 starting at bit `at`.
template <int W>
TPNORM_HD inline uint64_t bits_at(const Wide<W>& a, int at, int count) {
  const int k = at >> 6, b = at & 63;
  uint64_t v = k < W ? a.w[k] >> b : 0;
  if (b && k + 1 < W) v |= a.w[k + 1] << (64 - b);
  return count >= 64 ? v : v & ((uint64_t{1} << count) - 1);
}

/// Whether a >= 0 has a set bit below bit `at`.
template <int W>
TPNORM_HD inline bool any_below(const Wide<W>& a, int at) {
  const int k = at >> 6, b = at & 63;
  for (int i = 0; i < k && i < W; ++i)
    if (a.w[i]) return true;
  return b && k < W && (a.w[k] & ((uint64_t{1} << b) - 1));
}

/// q = a / d for a >= 0, d > 0; returns the remainder.
template <int W>
TPNORM_HD inline uint64_t divide(Wide<W>& a, uint64_t d) {
  uint64_t rem = 0;
  for (int i = W - 1; i >= 0; --i) {
    const u128 cur = (static_cast<u128>(rem) << 64) | a.w[i];
    a.w[i] = static_cast<uint64_t>(cur / d);
    rem = static_cast<uint64_t>(cur % d);
  }
  return rem;
}

/// num / den * 2^exp2 rounded once to the nearest double (ties to even); num >= 0, den > 0.
/// Results here stay far from double's subnormals and overflow (|exp2| < 400, num < 2^500).
/// One 128-by-64-bit division, whatever W: with top = the 128 bits of num from its leading one
/// (num = top * 2^k + low, 0 <= low < 2^k; k < 0 shifts num up), num / den = 2^k (q + (r +
/// low / 2^k) / den) with q, r the quotient and remainder of top / den, and the last fraction
/// in [0, 1), zero only when r and low are: q (>= 2^63, so >= 53 bits and a rounding bit) and
/// whether anything is left decide the rounding.
template <int W>
TPNORM_HD inline double ratio(const Wide<W>& num, uint64_t den, int exp2) {
  const int b = bit_length(num);
  if (b == 0) return 0.0;
  const int k = b - 128;
  u128 top;
  bool low = false;
  if (k >= 0) {
    top = (static_cast<u128>(bits_at(num, k + 64, 64)) << 64) | bits_at(num, k, 64);
    low = any_below(num, k);
  } else {
    top = ((static_cast<u128>(bits_at(num, 64, 64)) << 64) | bits_at(num, 0, 64)) << -k;
  }
  const u128 q = top / den;
  const bool rest = top - q * den != 0 || low;
  const int qb = (q >> 64) != 0 ? 64 + bit_length64(static_cast<uint64_t>(q >> 64))
                                : bit_length64(static_cast<uint64_t>(q));
  const int t = qb - 53;  // >= 11
  uint64_t mant = static_cast<uint64_t>(q >> t);
  const bool half = ((q >> (t - 1)) & 1) != 0;
  const bool below = (q & ((static_cast<u128>(1) << (t - 1)) - 1)) != 0;
  if (half && (rest || below || (mant & 1))) ++mant;  // 2^53 after a carry is still exact
  return std::ldexp(static_cast<double>(mant), t + k + exp2);
}

/// Splits v into `limbs` int64 limbs of kLimbBits bits (all but the top one in [0, 2^52)).
template <int W>
TPNORM_HD inline void pack(const Wide<W>& v, int64_t* out, int limbs) {
  constexpr uint64_t mask = (uint64_t{1} << kLimbBits) - 1;
  for (int i = 0; i + 1 < limbs; ++i)
    out[i] = static_cast<int64_t>(bits_at(v, kLimbBits * i, kLimbBits) & mask);
  // The top limb: an arithmetic shift of v by kLimbBits * (limbs - 1), which fits in 63 bits.
  const int at = kLimbBits * (limbs - 1);
  uint64_t top = bits_at(v, at, 64);
  if (is_negative(v)) {
    const int above = 64 * W - at;  // bits of v from `at` up, sign-extend the rest
    if (above < 64) top |= ~uint64_t{0} << above;
  }
  out[limbs - 1] = static_cast<int64_t>(top);
}

/// The sum of limbs[i] * 2^(kLimbBits i), limbs in any range (e.g. summed over ranks).
template <int W>
TPNORM_HD inline Wide<W> unpack(const int64_t* limbs, int count) {
  Wide<W> r;
  for (int i = 0; i < count; ++i) add_shifted(r, limbs[i], kLimbBits * i);
  return r;
}

/// sum v / n, rounded once. n >= 1.
TPNORM_HD inline double mean(const Sum1& s1, uint64_t n) {
  const double m = ratio(magnitude(s1), n, kValueLsb);
  return is_negative(s1) ? -m : m;
}

/// (n sum v^2 - (sum v)^2) / n^2, the population variance, rounded once. 1 <= n < 2^32.
/// The numerator is an integer (no cancellation) on the grid of (sum v)^2, 2^(2 kValueLsb):
/// n sum v^2 shifted up by kSquareLsb - 2 kValueLsb = 94 bits (< 2^490). It is >= 0 by
/// Cauchy-Schwarz for exact squares; truncated squares (values under 2^-79) can take it below
/// zero by less than n^2 2^-204, and the variance is then 0.
TPNORM_HD inline double variance(const Sum1& s1, const Sum2& s2, uint64_t n) {
  static_assert(kSquareLsb - 2 * kValueLsb >= 0, "squares' grid no finer than (sum v)^2's");
  const Sum1 m1 = magnitude(s1);
  Sum2 num = shifted_left(times(s2, n), kSquareLsb - 2 * kValueLsb);
  add(num, negated(product(m1, m1)));
  if (is_negative(num)) return 0.0;
  return ratio(num, n * n, 2 * kValueLsb);
}

/// sum v^2 / n, rounded once. n >= 1.
TPNORM_HD inline double mean_square(const Sum2& s2, uint64_t n) { return ratio(s2, n, kSquareLsb); }

}  // namespace tpnorm::exact
