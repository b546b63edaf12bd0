// exact_channels.h — the CPU kernels of Stats::kExact for SyncBatchNorm: each channel's sums
// over this rank's elements as exact integers (common/exact_sum.h) packed into int64 limbs,
// and the summed limbs turned into the values the ordinary apply kernels take
// (kernels/cpu/batch_norm.h), each rounded once.
//
// Limbs per channel (exact::moment_limbs), `bad` first (values left out: not finite or
// |v| >= 2^64; the channel's statistics become NaN):
//   forward  {bad, sum x (5), sum x^2 (9)} = 15     backward {bad, sum dy (5), sum dy*xmu (5)} = 11
// with xmu = (x - head) - tail, the saved mean split into floats as bn_apply_backward does.
#pragma once

#include <cstdint>

#include "kernels/cpu/batch_norm.h"

namespace tpnorm::kernels::cpu {

template <class T>
void bn_exact_partial_forward(const BatchNormArgs& a, const T* x, int64_t* limbs);

template <class T, class S>
void bn_exact_partial_backward(const BatchNormArgs& a, const T* dy, const T* x, const S* mean,
                               int64_t* limbs);

/// Forward: mean[c] and the biased var[c] from the summed limbs, each rounded once (NaN for a
/// channel with a bad value). n: the global count per channel (> 0).
void bn_exact_moments(int64_t c, const int64_t* limbs, double n, double* mean, double* var);

/// Backward: sums[2c] = {sum dy / d, sum dy*xmu / d}, each rounded once (NaN for a bad
/// channel). With d = n (summed limbs) they feed bn_apply_backward with n = 1; with d = 1
/// (this rank's limbs) bn_param_grads.
void bn_exact_backward_sums(int64_t c, const int64_t* limbs, double d, double* sums);

}  // namespace tpnorm::kernels::cpu
