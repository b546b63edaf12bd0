// exact_groups.h — the CPU kernels of Stats::kExact for GroupNorm / InstanceNorm (the geometry of
// kernels/cpu/group_norm.h: NCHW, this rank's channels [c0, c0 + c_local)).
//
// Per (sample, group) slot, for ALL groups (slots a rank does not touch stay zero), int64 limbs of
// exact sums (common/exact_sum.h; exact::moment_limbs per slot), `bad` first (values left out:
// not finite or |v| >= 2^64):
//   forward  {bad, sum x (5), sum x^2 (9)} = 15     backward {bad, sum g (5), sum g*xhat (5)} = 11
// with g = dy * gamma[c] and xhat = ((x - head) - tail) * rstd formed in float32 as the apply
// kernel forms them. A group's channels on this rank are one contiguous run of each sample, so
// each slot is one run of exact_accumulate. The backward also sums, per local channel, dy*xhat
// and dy exactly (dgamma / dbeta), rounded once: the same bits for any split and thread count.
#pragma once

#include <cstdint>

#include "kernels/cpu/group_norm.h"

namespace tpnorm::kernels::cpu {

template <class T>
void group_exact_partial_forward(const GroupNormArgs& a, const T* x, int64_t* limbs);

/// dparams [2 * c_local] = {sum dy*xhat per channel, sum dy per channel}, each rounded once.
template <class T, class S>
void group_exact_partial_backward(const GroupNormArgs& a, const T* dy, const T* x, const T* gamma,
                                  const S* mean, const S* rstd, int64_t* limbs, double* dparams);

/// stats [2 * n * groups] from the summed limbs, each rounded once (NaN for a slot with a bad
/// value): forward {mean, variance}, for group_apply_forward with GroupNormArgs::final_stats;
/// backward {sum g / count, sum g*xhat / count}, for group_apply_backward with count = 1.
void exact_group_finish(const GroupNormArgs& a, bool forward, const int64_t* limbs, double count,
                        double* stats);

}  // namespace tpnorm::kernels::cpu
