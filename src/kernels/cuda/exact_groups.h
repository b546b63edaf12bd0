// exact_groups.h — CUDA kernels of Stats::kExact for GroupNorm / InstanceNorm: the same payload
// and the same outputs, bit for bit, as the CPU kernels (kernels/cpu/exact_groups.h,
// kernels/cpu/group_norm.cpp with final_stats). Geometry: kernels/cuda/group_norm.h's GroupArgs.
//
// Partials: a block per (sample, group) slot sums the slot's run of this rank's channels with
//   the exact accumulator (kernels/cuda/exact_acc.h) into the CPU's int64 limbs (all slots;
//   a slot without local channels gets zeros): forward {bad, sum x, sum x^2} (15), backward
//   {bad, sum g, sum g*xhat} (11). The backward also sums, a block per local channel, dy*xhat
//   and dy exactly, rounded once to double, into scratch [2 * c_local] (dgamma / dbeta).
// Applies: a finish kernel turns each slot's summed limbs into its final statistics (in place)
//   (forward: also the saved mean / rstd), then the CPU's float32 formulas per element, every
//   operation spelled out with __f*_rn (the CPU's y = fma(xc, rstd * gamma, beta) is
//   __fmaf_rn). Every apply kernel checks the summed int64 header (error flag, fingerprint,
//   and that the ranks' channel counts add up to all channels) and writes nothing on a failed
//   call but *err = 1.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/call_header.h"
#include "kernels/cuda/group_norm.h"

namespace tpnorm::kernels::cuda {

template <class T>
void exact_group_partial_forward(const GroupArgs& a, const T* x, int64_t* limbs);

/// count: elements per group over all ranks (cpg * spatial). mean / rstd [n * groups] or null.
template <class T>
void exact_group_apply_forward(const GroupArgs& a, const Header& hd, double count, double eps,
                               const T* x, const T* gamma, const T* beta, T* y, void* mean,
                               void* rstd, int* err);

/// dparams: device scratch of at least exact_group_scratch_bytes(a).
template <class T>
void exact_group_partial_backward(const GroupArgs& a, const T* dy, const T* x, const T* gamma,
                                  const void* mean, const void* rstd, int64_t* limbs,
                                  double* dparams);

template <class T>
void exact_group_apply_backward(const GroupArgs& a, const Header& hd, double count, const T* dy,
                                const T* x, const T* gamma, const void* mean, const void* rstd,
                                T* dx, T* dgamma, T* dbeta, const double* dparams, int* err);

/// Scratch bytes of the backward's per-channel sums.
inline size_t exact_group_scratch_bytes(const GroupArgs& a) {
  return a.c_local > 0 ? static_cast<size_t>(2 * a.c_local) * sizeof(double) : 0;
}

}  // namespace tpnorm::kernels::cuda
