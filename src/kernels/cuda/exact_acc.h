// exact_acc.h — one thread's exact sums on the GPU (Stats::kExact; the grid and the limbs are
// common/exact_sum.h's). Plain C++ marked TPNORM_HD, no CUDA types: the CUDA kernels
// (kernels/cuda/exact_rows.cu) run it per thread and the host tests
// (tests/gpu/host_test_gpu_exact_acc.cpp) run it against the CPU accumulator.
//
// Why a window: adding each value into a 256-bit (and its square into a 512-bit) integer costs
// a carry chain per value. Instead, the threads of a row first agree on the largest biased
// exponent emax of the row's good values (an integer max: any order gives the same), which
// fixes a unit 2^(elo-150) with elo = max(1, emax - kWindow). A value ±m * 2^(e-150) with e in
// [elo, emax] is then the integer M = ±m * 2^(e-elo), |M| < 2^(24+kWindow) = 2^48, and a thread
// keeps sum M in int64 and sum M^2 in 128 bits; every kFlush values (and at the end) it adds
// them, shifted, into its wide sums. The rare value below the window (more than kWindow binades
// under the row's largest) goes into the wide sums directly. With squares the window's low end
// is at least exact::kSquareExactExp, so every square summed fast lies on the square grid, and
// the squares that exact_sum.h truncates (|v| < 2^-79) all take the direct path, truncated
// there as on the CPU. Either way the integers are those of the CPU (kernels/cpu/exact_bins.h)
// whatever the split into threads.
//
// Bad values (not finite, |v| >= 2^64: biased exponent >= kExpLimit) are counted and left out,
// as on the CPU.
//
// Headroom: kFlush = 2^14 values of |M| < 2^48: |sum M| < 2^62; sum M^2 < 2^110.
#pragma once

#include <cstdint>

#include "common/exact_sum.h"

namespace tpnorm::kernels::cuda {

inline constexpr int kExactExpLimit = 127 + exact::kMaxExp;  ///< biased exponents >= this: bad
inline constexpr int kExactWindow = 24;                      ///< binades below emax kept fast
inline constexpr int kExactFlush = 1 << 14;                  ///< fast adds between flushes

/// The biased exponent of a good value's bits (0 for zero and subnormals), or 0 when the value
/// is bad: what the threads of a row take the max of.
TPNORM_HD inline int exact_good_exponent(uint32_t u) {
  const int be = static_cast<int>((u >> 23) & 0xffu);
  return be < kExactExpLimit ? be : 0;
}

/// elo for a row whose good values have the largest biased exponent emax; `lowest` = 1, or
/// exact::kSquareExactExp for sums of squares.
TPNORM_HD inline int exact_window_low(int emax, int lowest = 1) {
  return emax - kExactWindow > lowest ? emax - kExactWindow : lowest;
}

/// One thread's exact sum of values and, with kSquares, of their squares.
template <bool kSquares>
struct ExactAcc {
  int elo = 1;
  int pending = 0;
  int64_t s = 0;      // sum M, units of 2^(elo-150)
  exact::u128 q = 0;  // sum M^2, units of 2^(2 elo - 300)
  exact::Sum1 s1;     // units of 2^kValueLsb
  exact::Sum2 s2;     // units of 2^kSquareLsb (kSquares only)
  int64_t bad = 0;

  TPNORM_HD explicit ExactAcc(int emax)
      : elo(exact_window_low(emax, kSquares ? exact::kSquareExactExp : 1)) {}

  /// Adds the float whose bits are u.
  TPNORM_HD void add(uint32_t u) {
    const int be = static_cast<int>((u >> 23) & 0xffu);
    if (be >= kExactExpLimit) {
      ++bad;
      return;
    }
    const uint64_t mag = (u & 0x7fffffu) | (be != 0 ? 0x800000u : 0u);
    if (mag == 0) return;  // +-0
    const int e = be + (be == 0);
    const bool neg = (u >> 31) != 0;
    const int d = e - elo;
    if (d >= 0 && d <= kExactWindow) {
      const int64_t m = static_cast<int64_t>(mag << d);  // < 2^48
      s += neg ? -m : m;
      if (kSquares) q += static_cast<exact::u128>(m) * static_cast<uint64_t>(m);
      if (++pending == kExactFlush) flush();
      return;
    }
    // Below the window (or, defensively, above it): straight into the wide sums.
    exact::add_shifted(s1, neg ? -static_cast<int64_t>(mag) : static_cast<int64_t>(mag), e - 1);
    if (kSquares)
      exact::add_shifted_unsigned(s2, exact::square_units(mag, e), exact::square_shift(e));
  }

  /// Moves the fast sums into the wide ones (call once more at the end).
  TPNORM_HD void flush() {
    if (s != 0) exact::add_shifted(s1, s, elo - 1);
    if (kSquares && q != 0) {  // elo >= kSquareExactExp: q's squares are on the grid
      const int at = exact::square_shift(elo);
      exact::add_shifted_unsigned(s2, static_cast<uint64_t>(q), at);
      exact::add_shifted_unsigned(s2, static_cast<uint64_t>(q >> 64), at + 64);
    }
    s = 0;
    q = 0;
    pending = 0;
  }
};

/// Writes one sum as kLimbs1 (or kLimbs2) int64 limbs: exact::pack, the CPU's layout.
/// Limbs of up to kMaxRanks partial sums add without overflow, so a row's threads add their
/// limbs as int64 and normalize() makes them the limbs of the row's sum again.
template <int W>
TPNORM_HD inline void exact_normalize(int64_t* limbs, int count) {
  const exact::Wide<W> v = exact::unpack<W>(limbs, count);
  exact::pack(v, limbs, count);
}

}  // namespace tpnorm::kernels::cuda
