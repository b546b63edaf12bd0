// exact_bins.h — the CPU accumulator of exact sums (see common/exact_sum.h for the grid).
//
// A float v = ±m * 2^(e-150) (e its biased exponent, m its 24-bit significand with the implicit
// bit; a subnormal, e = 0, is read as e = 1 without it) adds ±m to bin a[e] and, for a sum of
// squares, m^2 to bin b[e]: a few integer instructions per value whatever its size, and integer
// adds, so the order of the values does not matter. fold() shifts every bin into the wide sums
// (bin e of a counts units of 2^(e-1) * 2^-149, of b units of 2^(2e-2) * 2^-298) and empties it.
//
// Headroom: m^2 < 2^48, so a bin takes kBatch = 2^14 adds before a fold; add_* fold by
// themselves every kBatch values. Values are spread over kCopies copies of the bins (value j
// into copy j % kCopies), so that runs of values with the same exponent make independent
// read-modify-write chains instead of one chain through store-to-load forwarding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common/exact_sum.h"
#include "common/half.h"

namespace tpnorm::kernels::cpu {

class ExactBins {
 public:
  /// Biased exponents at or above this are bad: |v| >= 2^64, inf, nan.
  static constexpr int kExpLimit = 127 + exact::kMaxExp;
  static constexpr int kCopies = 4;
  static constexpr int64_t kBatch = int64_t{1} << 14;

  ExactBins() { clear(); }

  /// Adds n values value(j) (floats) to the sum of values and the sum of their squares.
  template <class Value>
  void add_values_and_squares(int64_t n, Value value) {
    in_batches(
        n, [&](int c, int64_t j) { put_square(c, value(j)); }, [&] { fold_squares(); });
  }

  /// Adds n pairs (first(j), second(j)) to two sums of values (e.g. sum g and sum g*xhat).
  template <class Pair>
  void add_pairs(int64_t n, Pair pair) {
    in_batches(
        n,
        [&](int c, int64_t j) {
          const auto p = pair(j);
          put_pair(c, p.first, p.second);
        },
        [&] { fold_pairs(); });
  }

  /// The sums so far (values left out as bad are counted in bad()).
  const exact::Sum1& sum() const { return s1_; }
  const exact::Sum2& sum_of_squares() const { return s2_; }
  const exact::Sum1& second_sum() const { return t1_; }
  int64_t bad() const { return bad_; }

  void clear() {
    std::memset(a_, 0, sizeof a_);
    std::memset(b_, 0, sizeof b_);
    s1_ = {};
    s2_ = {};
    t1_ = {};
    bad_ = 0;
  }

 private:
  static constexpr int kBins = kExpLimit;

  // put(c, j) for j in [0, n): value j into copy c = j % kCopies (the tail into copy 0), and
  // fold() after every kBatch values, before a bin can overflow (see the headroom above).
  template <class Put, class Fold>
  void in_batches(int64_t n, Put put, Fold fold) {
    for (int64_t j0 = 0; j0 < n; j0 += kBatch) {
      const int64_t j1 = j0 + kBatch < n ? j0 + kBatch : n;
      int64_t j = j0;
      for (; j + kCopies <= j1; j += kCopies)
        for (int c = 0; c < kCopies; ++c) put(c, j + c);
      for (; j < j1; ++j) put(0, j);
      fold();
    }
  }

  // Biased exponent (subnormals as 1) and signed significand of v; false if v is bad.
  static bool split(float v, int& e, int64_t& m) {
    const uint32_t u = float_bits(v);
    const int be = static_cast<int>((u >> 23) & 0xffu);
    const int64_t mag = static_cast<int64_t>((u & 0x7fffffu) | (be != 0 ? 0x800000u : 0u));
    e = be + (be == 0);
    m = (u >> 31) ? -mag : mag;
    return be < kExpLimit;
  }

  void put_square(int c, float v) {
    int e;
    int64_t m;
    if (!split(v, e, m)) {
      ++bad_;
      return;
    }
    a_[c][e] += m;
    b_[c][e] += m * m;
  }

  void put_pair(int c, float v, float w) {
    int e;
    int64_t m;
    if (split(v, e, m))
      a_[c][e] += m;
    else
      ++bad_;
    if (split(w, e, m))
      b_[c][e] += m;
    else
      ++bad_;
  }

  void fold_squares() {
    for (int e = 1; e < kBins; ++e) {
      int64_t a = 0, b = 0;
      for (int c = 0; c < kCopies; ++c) a += a_[c][e], b += b_[c][e], a_[c][e] = b_[c][e] = 0;
      if (a) exact::add_shifted(s1_, a, e - 1);
      if (b) exact::add_shifted(s2_, b, 2 * e - 2);
    }
  }

  void fold_pairs() {
    for (int e = 1; e < kBins; ++e) {
      int64_t a = 0, b = 0;
      for (int c = 0; c < kCopies; ++c) a += a_[c][e], b += b_[c][e], a_[c][e] = b_[c][e] = 0;
      if (a) exact::add_shifted(s1_, a, e - 1);
      if (b) exact::add_shifted(t1_, b, e - 1);
    }
  }

  int64_t a_[kCopies][kBins];
  int64_t b_[kCopies][kBins];
  exact::Sum1 s1_, t1_;
  exact::Sum2 s2_;
  int64_t bad_ = 0;
};

/// One value into the wide sums directly (the slow path of exact_accumulate).
inline void exact_add_one(float v, exact::Sum1& s1, exact::Sum2* s2, int64_t& bad) {
  const uint32_t u = float_bits(v);
  const int be = static_cast<int>((u >> 23) & 0xffu);
  if (be >= ExactBins::kExpLimit) {
    ++bad;
    return;
  }
  const int e = be + (be == 0);
  const int64_t mag = static_cast<int64_t>((u & 0x7fffffu) | (be != 0 ? 0x800000u : 0u));
  exact::add_shifted(s1, (u >> 31) ? -mag : mag, e - 1);
  if (s2) exact::add_shifted(*s2, mag * mag, 2 * e - 2);
}

/// Adds the exact sum of x[0, n) to s1 and, when s2 is not null, of their squares to *s2; bad
/// values (see ExactBins) are counted in `bad` and left out. Exact, so any method gives the
/// same integers: with AVX-512 IFMA the vector path below, otherwise ExactBins.
///
/// The vector path, per chunk of kChunk values: emax = the largest biased exponent, and the
/// chunk's unit 2^(elo-150) with elo = emax - 27. A value with exponent in [elo, emax] is an
/// integer M of units, |M| < 2^51, so d = v * 2^(150-elo) + 1.5 * 2^52 (one FMA in double) is
/// exact and its 52 significand bits are M + 2^51: adding d's bits as int64 sums M (less a
/// known multiple of the bias), and vpmadd52{l,h}uq add the two 52-bit halves of (M + 2^51)^2,
/// from which sum M^2 = sum (M + 2^51)^2 - 2^52 sum M - count * 2^102 exactly. 2^10 adds a lane
/// fit. The rare values below the window (0 < |v| < 2^(elo-127)) take exact_add_one and are
/// zeroed in the vector; a chunk holding a bad value goes through exact_add_one whole.
inline void exact_accumulate(const float* x, int64_t n, exact::Sum1& s1, exact::Sum2* s2,
                             int64_t& bad) {
#if defined(__AVX512F__) && defined(__AVX512IFMA__)
  constexpr int64_t kChunk = int64_t{1} << 14;  // 2^10 adds in each of 2 x 8 lanes
  constexpr int kWindow = 27;                   // 24 + 27 = 51 bits: |M| < 2^51
  constexpr double kBias = 6755399441055744.0;  // 1.5 * 2^52
  constexpr uint64_t kBiasBits = 0x4338000000000000ULL;
  const __m512d bias = _mm512_set1_pd(kBias);
  const __m512i abs32 = _mm512_set1_epi32(0x7fffffff), one32 = _mm512_set1_epi32(1);
  for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
    const int64_t j1 = j0 + kChunk < n ? j0 + kChunk : n;
    // The largest |v| as bits: NaN and inf compare above every finite value.
    __m512i mx = _mm512_setzero_si512();
    int64_t j = j0;
    for (; j + 16 <= j1; j += 16)
      mx = _mm512_maskz_max_epu32(0xffff, mx, _mm512_and_si512(_mm512_loadu_si512(x + j), abs32));
    alignas(64) uint32_t lanes[16];  // through memory: GCC 12 warns on in-register extraction
    _mm512_store_si512(lanes, mx);
    uint32_t top = 0;
    for (uint32_t t : lanes) top = std::max(top, t);
    for (; j < j1; ++j) top = std::max(top, float_bits(x[j]) & 0x7fffffffu);
    const int emax = static_cast<int>(top >> 23);
    if (emax >= ExactBins::kExpLimit) {
      for (j = j0; j < j1; ++j) exact_add_one(x[j], s1, s2, bad);
      continue;
    }
    const int elo = std::max(1, emax - kWindow);
    const __m512d scale = _mm512_set1_pd(std::ldexp(1.0, 150 - elo));
    // 0 < |v| < 2^(elo-127)  <=>  bits(|v|) - 1 < (elo << 23) - 1 (unsigned; 0 wraps high).
    const __m512i below = _mm512_set1_epi32((elo << 23) - 1);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, l0 = a0, l1 = a0, h0 = a0, h1 = a0;
    uint64_t count = 0;  // adds in every lane
    for (j = j0; j + 16 <= j1; j += 16, ++count) {
      const __m512i ab = _mm512_and_si512(_mm512_loadu_si512(x + j), abs32);
      const __mmask16 slow = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(ab, one32), below);
      __m256 v0 = _mm256_loadu_ps(x + j), v1 = _mm256_loadu_ps(x + j + 8);
      if (slow) {
        alignas(32) float t[16];
        for (int l = 0; l < 16; ++l) {
          t[l] = x[j + l];
          if (slow >> l & 1) exact_add_one(t[l], s1, s2, bad), t[l] = 0.0f;
        }
        v0 = _mm256_load_ps(t);
        v1 = _mm256_load_ps(t + 8);
      }
      // maskz_ conversions: the plain ones trip GCC 12's -Wmaybe-uninitialized false positive.
      const __m512i d0 =
          _mm512_castpd_si512(_mm512_fmadd_pd(_mm512_maskz_cvtps_pd(0xff, v0), scale, bias));
      const __m512i d1 =
          _mm512_castpd_si512(_mm512_fmadd_pd(_mm512_maskz_cvtps_pd(0xff, v1), scale, bias));
      a0 = _mm512_add_epi64(a0, d0);
      a1 = _mm512_add_epi64(a1, d1);
      if (s2) {
        l0 = _mm512_madd52lo_epu64(l0, d0, d0);
        h0 = _mm512_madd52hi_epu64(h0, d0, d0);
        l1 = _mm512_madd52lo_epu64(l1, d1, d1);
        h1 = _mm512_madd52hi_epu64(h1, d1, d1);
      }
    }
    for (; j < j1; ++j) exact_add_one(x[j], s1, s2, bad);
    alignas(64) uint64_t sa[16], sl[16], sh[16];
    _mm512_store_si512(sa, a0);
    _mm512_store_si512(sa + 8, a1);
    _mm512_store_si512(sl, l0);
    _mm512_store_si512(sl + 8, l1);
    _mm512_store_si512(sh, h0);
    _mm512_store_si512(sh + 8, h1);
    exact::Wide<4> sq;  // sum M^2 over the chunk's lanes
    for (int l = 0; l < 16; ++l) {
      const auto m = static_cast<int64_t>(sa[l] - count * kBiasBits);  // sum M, |.| < 2^61
      exact::add_shifted(s1, m, elo - 1);
      if (s2) {
        exact::add_shifted_unsigned(sq, sl[l], 0);
        exact::add_shifted_unsigned(sq, sh[l], 52);
        exact::add_shifted(sq, -m, 52);
        exact::add_shifted(sq, -static_cast<int64_t>(count), 102);
      }
    }
    if (s2) exact::add_shifted_wide(*s2, sq, 2 * elo - 2);
  }
#else
  ExactBins bins;
  if (s2) {
    bins.add_values_and_squares(n, [&](int64_t j) { return x[j]; });
    exact::add(*s2, bins.sum_of_squares());
  } else {
    bins.add_pairs(n, [&](int64_t j) { return std::pair<float, float>{x[j], 0.0f}; });
  }
  exact::add(s1, bins.sum());
  bad += bins.bad();
#endif
}

}  // namespace tpnorm::kernels::cpu
