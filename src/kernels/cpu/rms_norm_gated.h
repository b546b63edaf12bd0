// rms_norm_gated.h — CPU kernels of the gated RMSNorm (tpnorm/rms_norm_gated.h) on [rows,
// c_local] with the channel dim sharded: this rank's channels are [c0, c0 + c_local), channel c
// belongs to group c / group_size, and statistics are per (row, group) for ALL groups (slots of
// groups this rank holds no channel of stay 0). A group's channels on this rank are one
// contiguous run of each row, so each slot gets one run's sum.
//
// Stats per (row, group): forward {sum u^2}, backward {sum g*uhat}, u the normalized input
// (x * silu(z) gate first, else x) and g = dy * w (* silu(z) norm first). Every term is formed
// in the compute type A (float32; float64 for fp64 storage) element by element, so a term has
// the same bits wherever its channel sits: Stats::kExact sums the float32 terms exactly
// (kernels/cpu/exact_bins.h) and its statistics do not depend on the split.
#pragma once

#include <cstdint>

namespace tpnorm::kernels::cpu {

struct GatedArgs {
  int64_t rows = 0;
  int64_t c_local = 0;     ///< this rank's channels
  int64_t c0 = 0;          ///< first channel of this rank
  int64_t group_size = 1;  ///< channels per group
  int64_t groups = 1;      ///< all groups: hidden / group_size
  bool norm_before_gate = false;
  int threads = 0;
  /// Stats::kExact: `stats` holds each slot's final value, rounded once from exact sums:
  /// forward {mean square}, backward {sum g*uhat / n} (exact_row_finish on rows * groups rows).
  bool final_stats = false;
};

/// Writes the slots of this rank's groups in stats [rows * groups] (zeroed by the caller).
/// z may be null (no gate).
template <class T, class W>
void gated_partial_forward(const GatedArgs& a, const T* x, const T* z, W* stats);

/// Stats::kExact: int64 limbs {bad, sum u^2 (7)} per slot (exact_row_limbs(false, true)).
template <class T>
void gated_exact_partial_forward(const GatedArgs& a, const T* x, const T* z, int64_t* limbs);

/// n: channels per group over all ranks. Writes y, and rstd [rows * groups] when non-null.
/// w may be null (= 1).
template <class T, class P, class W, class S>
void gated_apply_forward(const GatedArgs& a, const T* x, const T* z, const P* w, const W* stats,
                         double n, double eps, T* y, S* rstd);

/// Writes the slots of this rank's groups in stats [rows * groups] (zeroed by the caller), and,
/// when dw is non-null, dw [c_local] = each channel's sum over rows of its dweight terms in
/// float64, added in row order (the same bits for any split and thread count).
template <class T, class P, class W, class S>
void gated_partial_backward(const GatedArgs& a, const T* dy, const T* x, const T* z, const P* w,
                            const S* rstd, W* stats, double* dw);

/// Stats::kExact: int64 limbs {bad, sum g*uhat (5)} per slot (exact_row_limbs(false, false)),
/// and dw as gated_partial_backward.
template <class T, class P, class S>
void gated_exact_partial_backward(const GatedArgs& a, const T* dy, const T* x, const T* z,
                                  const P* w, const S* rstd, int64_t* limbs, double* dw);

/// Writes dx, dz (when z is non-null) and dweight [c_local] from dw (when non-null).
template <class T, class P, class W, class S>
void gated_apply_backward(const GatedArgs& a, const T* dy, const T* x, const T* z, const P* w,
                          const S* rstd, const W* stats, double n, const double* dw, T* dx, T* dz,
                          P* dweight);

}  // namespace tpnorm::kernels::cpu
