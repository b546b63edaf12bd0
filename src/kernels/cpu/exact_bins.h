// exact_bins.h — the CPU accumulators of exact sums (see common/exact_sum.h for the grid):
// ExactBins below, the simple one (the reference, and the fallback without AVX-512), and
// ExactStream further down, the kernels' one-pass vector path; both give the same integers.
//
// A float v = ±m * 2^(e-150) (e its biased exponent, m its 24-bit significand with the implicit
// bit; a subnormal, e = 0, is read as e = 1 without it) adds ±m to bin a[e] and, for a sum of
// squares, its square on the square grid, exact::square_units(m, e) (m^2, or m^2 truncated to
// the grid for |v| < 2^-79), to bin b[e]: a few integer instructions per value whatever its
// size, and integer adds, so the order of the values does not matter. fold() shifts every bin
// into the wide sums (bin e of a counts units of 2^(e-1) * 2^-149, of b units of
// 2^square_shift(e) * 2^kSquareLsb) and empties it.
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
#include "kernels/cpu/simd.h"

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
    b_[c][e] += static_cast<int64_t>(exact::square_units(static_cast<uint64_t>(m < 0 ? -m : m), e));
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
      if (b) exact::add_shifted(s2_, b, exact::square_shift(e));
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

/// One value into the wide sums directly (the slow path of ExactStream, and its tails).
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
  if (s2)
    exact::add_shifted(*s2,
                       static_cast<int64_t>(exact::square_units(static_cast<uint64_t>(mag), e)),
                       exact::square_shift(e));
}

/// A prefetch into L2 that the compiler keeps: GCC 12 dropped __builtin_prefetch from the
/// exact kernels' loops (conditional prefetches inside the lambdas an ExactStream runs).
inline void prefetch_l2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

/// Where exact sums go: the sum of values, the sum of squares (null: not wanted), the count of
/// bad values left out.
struct ExactTarget {
  exact::Sum1* s1;
  exact::Sum2* s2;
  int64_t* bad;
};

/// ExactStream<kSquares>: the exact sum of float32 values fed a vector (vf, simd.h) at a time,
/// and with kSquares the sum of their squares, into one target; bad values are counted and
/// left out. The caller forms its values in registers (a row of x, or the backward's terms)
/// and the sums happen in the same pass: no buffer, no second read. With kColumns each lane
/// has its own target (lane l: column l of a run of vf::L columns, e.g. channels of a
/// channels-last row), so one stream sums vf::L columns at once.
///
/// With AVX-512 (and IFMA for the squares) the values go into int64 lanes. A window of
/// exponents [elo, ehi], ehi - elo = 27, fixes a unit 2^(elo-150): a value with its exponent in
/// the window is an integer M of units, |M| < 2^51, so d = v * 2^(150-elo) + 1.5 * 2^52 (one
/// FMA in double) is exact and its 52 significand bits are M + 2^51; adding d's bits as int64
/// sums M (less a known multiple of the bias), and vpmadd52{l,h}uq add the two 52-bit halves
/// of (M + 2^51)^2, from which sum M^2 = sum (M + 2^51)^2 - 2^52 sum M - count * 2^102 exactly.
/// The window is chosen in the same pass: a vector holding a value above it flushes the lanes
/// into the wide sums and reopens them with ehi = that value's exponent + kSlack, so ehi only
/// grows (a stream reopens at most ~190 / (kSlack + 1) times); the first such vector opens it.
/// Values below it (0 < |v| < 2^(elo-127): rare) and bad values take exact_add_one. With
/// squares the window never reaches below exact::kSquareExactExp (|v| >= 2^-79), so the
/// lanes only see squares that lie on the square grid, and the values whose squares must be
/// truncated (see exact_sum.h) all take exact_add_one, which truncates each as ExactBins
/// does (a row of only such tiny values is all slow path). A lane takes 2^10 adds between
/// flushes. Any window gives the same integers (they are exact, or truncated per value), so
/// nothing depends on the order, the vector width or how a row is cut into calls.
///
/// Otherwise the values are buffered and summed by ExactBins (kColumns: exact_add_one per
/// value): the same integers.
#if defined(__AVX512F__) && defined(__AVX512IFMA__)
inline constexpr bool kExactLanesSquares = true;
#else
inline constexpr bool kExactLanesSquares = false;
#endif
#if defined(__AVX512F__)
inline constexpr bool kExactLanes = true;
#else
inline constexpr bool kExactLanes = false;
#endif

template <bool kSquares, bool kColumns = false,
          bool kLanes = kSquares ? kExactLanesSquares : kExactLanes>
class ExactStream;

#if defined(__AVX512F__)
template <bool kSquares, bool kColumns>
class ExactStream<kSquares, kColumns, true> {
 public:
  /// One target for every value.
  ExactStream(exact::Sum1& s1, exact::Sum2* s2, int64_t& bad) : t_{{&s1, s2, &bad}} { open(0); }
  /// kColumns: targets[l] for lane l < width (lanes from width on must be zero).
  ExactStream(const ExactTarget* targets, int width) : width_(width) {
    for (int l = 0; l < width; ++l) t_[l] = targets[l];
    open(0);
  }
  ExactStream(const ExactStream&) = delete;
  ExactStream& operator=(const ExactStream&) = delete;

  /// The lanes and the window as a loop keeps them: locals of the loop (load, step, store),
  /// so that they stay in registers whatever the compiler makes of the stream object.
  struct Regs {
    __m512i a0, a1, l0, l1, h0, h1, vtop, vbelow;
    __m512d scale;
    uint64_t count;
  };
  Regs load() const { return {a0_, a1_, l0_, l1_, h0_, h1_, vtop_, vbelow_, scale_, count_}; }
  void store(const Regs& r) {
    a0_ = r.a0, a1_ = r.a1, l0_ = r.l0, l1_ = r.l1, h0_ = r.h0, h1_ = r.h1;
    count_ = r.count;
  }
  /// 16 values into r (the stream's state between load() and store()).
  __attribute__((always_inline)) void step(Regs& r, vf x) {
    __m512 v = x.v;
    const __m512i ab = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff));
    const __mmask16 out =
        _mm512_cmpgt_epu32_mask(ab, r.vtop) |
        _mm512_cmplt_epu32_mask(_mm512_sub_epi32(ab, _mm512_set1_epi32(1)), r.vbelow);
    if (__builtin_expect(out != 0, 0)) {
      store(r);
      v = outliers(v);
      r = load();
    }
    const __m512d bias = _mm512_set1_pd(6755399441055744.0);  // 1.5 * 2^52
    // maskz_ conversions: the plain ones trip GCC 12's -Wmaybe-uninitialized false positive.
    const __m512d lo = _mm512_maskz_cvtps_pd(0xff, _mm512_maskz_extractf32x8_ps(0xff, v, 0));
    const __m512d hi = _mm512_maskz_cvtps_pd(0xff, _mm512_maskz_extractf32x8_ps(0xff, v, 1));
    const __m512i d0 = _mm512_castpd_si512(_mm512_fmadd_pd(lo, r.scale, bias));
    const __m512i d1 = _mm512_castpd_si512(_mm512_fmadd_pd(hi, r.scale, bias));
    r.a0 = _mm512_add_epi64(r.a0, d0);
    r.a1 = _mm512_add_epi64(r.a1, d1);
    if constexpr (kSquares) {
      r.l0 = _mm512_madd52lo_epu64(r.l0, d0, d0);
      r.h0 = _mm512_madd52hi_epu64(r.h0, d0, d0);
      r.l1 = _mm512_madd52lo_epu64(r.l1, d1, d1);
      r.h1 = _mm512_madd52hi_epu64(r.h1, d1, d1);
    }
    if (__builtin_expect(++r.count == kMaxAdds, 0)) {
      store(r);
      flush();
      r = load();
    }
  }

  /// n vectors of 16 values, value(i) -> vf for i in [0, n).
  template <class Value>
  __attribute__((always_inline)) void add_n(int64_t n, Value value) {
    Regs r = load();
    for (int64_t i = 0; i < n; ++i) step(r, value(i));
    store(r);
  }
  /// 16 values.
  void add(vf x) {
    add_n(1, [&](int64_t) { return x; });
  }
  /// n < 16 values at t.
  void add_partial(const float* t, int n) {
    add(vf{_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), t)});
  }
  /// Everything added so far into the sums (call once, at the end).
  void finish() { flush(); }

 private:
  static constexpr int kWindow = 27;          // 24 + 27 = 51 bits: |M| < 2^51
  static constexpr int kSlack = 3;            // ehi = the exponent that opened it + kSlack
  static constexpr uint64_t kMaxAdds = 1024;  // adds a lane takes between flushes
  static constexpr uint64_t kBiasBits = 0x4338000000000000ULL;  // bits of 1.5 * 2^52
  // The lowest elo: with squares, the lowest exponent whose squares are on the grid.
  static constexpr int kLowest = kSquares ? exact::kSquareExactExp : 1;

  void open(int ehi) {
    ehi_ = std::min(std::max(ehi, kLowest + kWindow), ExactBins::kExpLimit - 1);
    elo_ = std::max(kLowest, ehi_ - kWindow);
    top_ = (static_cast<uint32_t>(ehi_ + 1) << 23) - 1;  // the largest |v| bits in the window
    vtop_ = _mm512_set1_epi32(static_cast<int>(top_));
    // 0 < |v| < 2^(elo-127)  <=>  bits(|v|) - 1 < (elo << 23) - 1 (unsigned; 0 wraps high).
    // At elo = 1 subnormals are in the window: nothing is below it.
    vbelow_ = _mm512_set1_epi32(elo_ > 1 ? (elo_ << 23) - 1 : 0);
    scale_ = _mm512_set1_pd(std::ldexp(1.0, 150 - elo_));
  }

  // The lanes into the wide sums, then empty. Per lane |sum M| < 2^10 * 2^51 = 2^61, each
  // 52-bit half of (M + 2^51)^2 sums below 2^62, and sum M^2 <= 2^112 (2^116 over 16 lanes).
  __attribute__((noinline)) void flush() {
    if (count_ == 0) return;
    const __m512i cb = _mm512_set1_epi64(static_cast<int64_t>(count_ * kBiasBits));
    alignas(64) int64_t m[16];
    alignas(64) uint64_t l[16], h[16];
    if constexpr (kColumns) {
      _mm512_store_si512(m, _mm512_sub_epi64(a0_, cb));
      _mm512_store_si512(m + 8, _mm512_sub_epi64(a1_, cb));
      if constexpr (kSquares) {
        _mm512_store_si512(l, l0_);
        _mm512_store_si512(l + 8, l1_);
        _mm512_store_si512(h, h0_);
        _mm512_store_si512(h + 8, h1_);
      }
      for (int c = 0; c < width_; ++c)
        to_target(t_[c], elo_, m[c], kSquares ? l[c] : 0, kSquares ? h[c] : 0, count_);
    } else {
      _mm512_store_si512(m, _mm512_add_epi64(_mm512_sub_epi64(a0_, cb), _mm512_sub_epi64(a1_, cb)));
      __int128 sm = 0;
      for (int i = 0; i < 8; ++i) sm += m[i];
      exact::u128 sl = 0, sh = 0;
      if constexpr (kSquares) {
        _mm512_store_si512(l, _mm512_add_epi64(l0_, l1_));
        _mm512_store_si512(h, _mm512_add_epi64(h0_, h1_));
        for (int i = 0; i < 8; ++i) sl += l[i], sh += h[i];
      }
      to_target(t_[0], elo_, sm, sl, sh, 16 * count_);
    }
    a0_ = a1_ = l0_ = l1_ = h0_ = h1_ = _mm512_setzero_si512();
    count_ = 0;
  }

  // Lanes' sums into a target: sm = sum M, sl / sh = sums of the low / high 52-bit halves of
  // (M + 2^51)^2 over `adds` values.
  static void to_target(ExactTarget t, int elo, __int128 sm, exact::u128 sl, exact::u128 sh,
                        uint64_t adds) {
    add_wide(*t.s1, static_cast<exact::u128>(sm), elo - 1, sm < 0);
    if constexpr (kSquares) {
      // Modulo 2^128: exact, since the result lies in [0, 2^116].
      const exact::u128 sq = sl + (sh << 52) - (static_cast<exact::u128>(sm) << 52) -
                             (static_cast<exact::u128>(adds) << 102);
      add_wide(*t.s2, sq, exact::square_shift(elo), false);  // elo >= kSquareExactExp
    }
  }

  // s += v * 2^shift, v a 128-bit two's-complement value (negative when `negative`).
  template <int W>
  static void add_wide(exact::Wide<W>& s, exact::u128 v, int shift, bool negative) {
    exact::Wide<W> t;
    t.w[0] = static_cast<uint64_t>(v);
    t.w[1] = static_cast<uint64_t>(v >> 64);
    for (int i = 2; i < W; ++i) t.w[i] = negative ? ~uint64_t{0} : 0;
    exact::add(s, exact::shifted_left(t, shift));
  }

  // A vector with lanes outside the window: bad lanes counted and zeroed, the window reopened
  // above the largest lane, lanes below it through exact_add_one and zeroed.
  __attribute__((noinline)) __m512 outliers(__m512 v) {
    alignas(64) float t[16];
    _mm512_store_ps(t, v);
    uint32_t need = 0;
    for (int l = 0; l < 16; ++l) {
      const uint32_t u = float_bits(t[l]) & 0x7fffffffu;
      if (u >= static_cast<uint32_t>(ExactBins::kExpLimit) << 23) {
        ++*t_[kColumns ? l : 0].bad;
        t[l] = 0.0f;
      } else if (u > top_) {
        need = std::max(need, u);
      }
    }
    if (need) {
      flush();
      open(static_cast<int>(need >> 23) + kSlack);
    }
    const uint32_t low = elo_ > 1 ? static_cast<uint32_t>(elo_) << 23 : 0;
    for (int l = 0; l < 16; ++l) {
      const uint32_t u = float_bits(t[l]) & 0x7fffffffu;
      if (u != 0 && u < low) {
        const ExactTarget to = t_[kColumns ? l : 0];
        exact_add_one(t[l], *to.s1, to.s2, *to.bad);
        t[l] = 0.0f;
      }
    }
    return _mm512_load_ps(t);
  }

  int ehi_ = 0, elo_ = 1;
  uint32_t top_ = 0;
  uint64_t count_ = 0;
  __m512i vtop_, vbelow_;
  __m512d scale_;
  __m512i a0_ = _mm512_setzero_si512(), a1_ = a0_, l0_ = a0_, l1_ = a0_, h0_ = a0_, h1_ = a0_;
  ExactTarget t_[kColumns ? 16 : 1];
  int width_ = 1;
};
#endif

template <bool kSquares, bool kColumns>
class ExactStream<kSquares, kColumns, false> {
 public:
  ExactStream(exact::Sum1& s1, exact::Sum2* s2, int64_t& bad) : t_{{&s1, s2, &bad}} {}
  ExactStream(const ExactTarget* targets, int width) : width_(width) {
    for (int l = 0; l < width; ++l) t_[l] = targets[l];
  }
  ExactStream(const ExactStream&) = delete;
  ExactStream& operator=(const ExactStream&) = delete;

  struct Regs {};
  Regs load() const { return {}; }
  void store(const Regs&) {}
  void step(Regs&, vf v) { add(v); }
  template <class Value>
  void add_n(int64_t n, Value value) {
    for (int64_t i = 0; i < n; ++i) add(value(i));
  }
  void add(vf v) {
    vstore(buf_ + n_, v);
    if constexpr (kColumns) {
      for (int l = 0; l < width_; ++l)
        exact_add_one(buf_[l], *t_[l].s1, kSquares ? t_[l].s2 : nullptr, *t_[l].bad);
      return;
    }
    if ((n_ += vf::L) + vf::L > kBuffer) flush();
  }
  void add_partial(const float* t, int n) {
    for (int l = 0; l < n; ++l) buf_[n_ + l] = t[l];
    if ((n_ += n) + vf::L > kBuffer) flush();
  }
  void finish() { flush(); }

 private:
  static constexpr int64_t kBuffer = 2048;
  void flush() {
    if (n_ == 0) return;
    const ExactTarget& t = t_[0];
    ExactBins bins;
    if (kSquares) {
      bins.add_values_and_squares(n_, [&](int64_t j) { return buf_[j]; });
      exact::add(*t.s2, bins.sum_of_squares());
    } else {
      bins.add_pairs(n_, [&](int64_t j) { return std::pair<float, float>{buf_[j], 0.0f}; });
    }
    exact::add(*t.s1, bins.sum());
    *t.bad += bins.bad();
    n_ = 0;
  }
  alignas(64) float buf_[kBuffer];
  int64_t n_ = 0;
  ExactTarget t_[kColumns ? vf::L : 1];
  int width_ = 1;
};

/// Two streams fed in one loop: value(i) -> {a, b} (vf each) for i in [0, n), a into sa and b
/// into sb, both streams' lanes in registers.
template <class A, class B, class Value>
__attribute__((always_inline)) inline void exact_add_both(A& sa, B& sb, int64_t n, Value value) {
  auto ra = sa.load();
  auto rb = sb.load();
  for (int64_t i = 0; i < n; ++i) {
    const auto p = value(i);
    sa.step(ra, p.a);
    sb.step(rb, p.b);
  }
  sa.store(ra);
  sb.store(rb);
}

/// Adds the exact sum of x[0, n) to s1 and, when s2 is not null, of their squares to *s2; bad
/// values (see ExactBins) are counted in `bad` and left out.
inline void exact_accumulate(const float* x, int64_t n, exact::Sum1& s1, exact::Sum2* s2,
                             int64_t& bad) {
  auto run = [&](auto& stream) {
    const int64_t full = n / vf::L;
    stream.add_n(full, [&](int64_t i) { return vload(x + i * vf::L); });
    if (full * vf::L < n) stream.add_partial(x + full * vf::L, static_cast<int>(n - full * vf::L));
    stream.finish();
  };
  if (s2) {
    ExactStream<true> stream(s1, s2, bad);
    run(stream);
  } else {
    ExactStream<false> stream(s1, nullptr, bad);
    run(stream);
  }
}

}  // namespace tpnorm::kernels::cpu
