// exact_rows.h — the CPU kernels of Stats::kExact for row norms (LayerNorm, RMSNorm).
//
// partial_*: each row's sums over this rank's columns as exact integers (common/exact_sum.h),
// packed into int64 limbs; the op adds the limbs over ranks (one int64 all-reduce); finish
// turns each row's summed limbs into statistics rounded once, which the ordinary apply kernels
// take as they are (RowNormArgs::final_stats). Any split of a row over ranks gives the same
// integers, hence the same statistics and the same outputs.
//
// Limbs per row (exact_row_limbs), `bad` first: the count of values left out of the sums (not
// finite, or |v| >= 2^64), which makes the row's statistics NaN:
//   forward   LayerNorm {bad, sum x (5), sum x^2 (9)} = 15   RMSNorm {bad, sum x^2 (9)} = 10
//   backward  LayerNorm {bad, sum g (5), sum g*xhat (5)} = 11  RMSNorm {bad, sum g*xhat (5)} = 6
// with g = dy * gamma and xhat computed as the apply kernels do (float32, from the saved
// mean/rstd), so every rank forms the same terms.
#pragma once

#include <cstdint>

#include "kernels/cpu/row_norm.h"

namespace tpnorm::kernels::cpu {

/// int64 limbs per row of the exact mode's payload (see above).
int exact_row_limbs(bool centered, bool forward);

template <class T>
void row_exact_partial_forward(const RowNormArgs& a, const T* x, int64_t* limbs);

template <class T, class P, class S>
void row_exact_partial_backward(const RowNormArgs& a, const T* dy, const T* x, const P* gamma,
                                const S* mean, const S* rstd, int64_t* limbs);

/// One row's final statistics (as exact_row_finish writes them) from the row itself, where one
/// rank holds the whole row: the apply kernels' fused path (RowNormArgs::fused), one pass over
/// memory. The integers are those the limbs would carry, so the bits are the same.
template <class T>
void exact_row_final_forward(bool centered, const T* xr, int64_t h, double* st);
template <class T, class P>
void exact_row_final_backward(bool centered, const T* dyr, const T* xr, const P* gamma, float mh,
                              float mt, float rs, int64_t h, double* st);

/// stats[rows * (centered ? 2 : 1)] from the summed limbs, each value rounded once to double:
/// forward {mean, variance} or {mean square}; backward {sum g / n, sum g*xhat / n} or
/// {sum g*xhat / n}. NaN for a row with a bad value; 0 when n == 0.
void exact_row_finish(const RowNormArgs& a, bool forward, const int64_t* limbs, double n,
                      double* stats);

}  // namespace tpnorm::kernels::cpu
