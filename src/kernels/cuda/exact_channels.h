// exact_channels.h — CUDA kernels of Stats::kExact for SyncBatchNorm: the same payload and the
// same outputs, bit for bit, as the CPU's kExact path (kernels/cpu/exact_channels.h,
// ops/batch_norm.cpp, kernels/cpu/batch_norm.cpp). Geometry: kernels/cuda/batch_norm.h's BnArgs
// ([outer, c, inner]); the arithmetic: kernels/cuda/exact_channels_math.h (host-tested).
//
// Partials: a 256-thread block per (channel, split) of the channel's elements (bn_exact_plan:
//   large N * H * W over many blocks) forms the exact integers with the exact accumulator
//   (kernels/cuda/exact_acc.h) into int64 limbs in scratch; a thread per channel adds its
//   splits' limbs (int64: any split gives the same integers) into the CPU's payload
//   (exact::moment_limbs: forward {bad, sum x, sum x^2}, backward {bad, sum dy, sum dy*xmu}).
//   The backward also rounds this rank's sums once into scratch (dgamma / dbeta, as the CPU).
//   A rank without elements writes zero limbs.
// Applies: a thread per channel makes the channel's constants (forward: the exact mean and
//   variance rounded once, invstd, the saved and the running statistics — or, in eval, the
//   running statistics' constants), then a grid-stride loop over the elements applies the
//   CPU's float32 formulas. Every kernel after the collective checks the summed int64 header
//   (error flag, fingerprint, 0 <= n < 2^32, and n > 1 for the forward's batch statistics) and
//   writes nothing on a failed call but *err = 1. hd.base == nullptr: a call without a
//   collective (eval), nothing to check.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/batch_norm.h"

namespace tpnorm::kernels::cuda {

/// Device scratch bytes of the functions below (either pass).
size_t exact_bn_scratch_bytes(const BnArgs& a);

template <class T>
void exact_bn_partial_forward(const BnArgs& a, const T* x, int64_t* limbs, void* scratch);

/// f: as for bn_forward_stats (hd.base == nullptr: eval from the running statistics).
template <class T>
void exact_bn_apply_forward(const BnArgs& a, const BnForwardStats& f, const T* gamma, const T* beta,
                            const T* x, T* y, void* scratch, int* err);

/// limbs: the payload (nullptr in eval, where only this rank's sums for dgamma / dbeta are made).
template <class T>
void exact_bn_partial_backward(const BnArgs& a, const T* dy, const T* x, const void* mean, bool s64,
                               int64_t* limbs, void* scratch);

/// hd.base == nullptr: eval (dx with zero sums); dgamma / dbeta from the partial's own sums.
template <class T>
void exact_bn_apply_backward(const BnArgs& a, const Header& hd, const T* dy, const T* x,
                             const T* gamma, const void* mean, const void* invstd, bool s64, T* dx,
                             T* dgamma, T* dbeta, void* scratch, int* err);

}  // namespace tpnorm::kernels::cuda
