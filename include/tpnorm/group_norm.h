// tpnorm/group_norm.h — GroupNorm and InstanceNorm on NCHW, channels optionally sharded.
//
// x is [N, C_local, *spatial] (at least 2 dims; S = product of the spatial dims, 1 for [N, C]).
// This rank holds the contiguous channels [channel_offset, channel_offset + C_local) of C in
// all; the slices of all ranks must tile [0, C) (C_local may be 0). Channel c belongs to group
// c / (C/G); a group may span ranks. Unsharded use (any world size 1 communicator): C = C_local,
// offset 0. With n = (C/G) * S elements per (sample, group), over all ranks:
//
//   mu[s,g] = sum(x)/n   var = max(sum(x^2)/n - mu^2, 0)   rstd = 1/sqrt(var + eps)
//   xhat = (x - mu[s, g(c)]) * rstd[s, g(c)]                y = gamma[c] * xhat + beta[c]
//   backward, g = dy * gamma[c], sums over the (sample, group) across ranks:
//   dx = rstd * (g - sum(g)/n - xhat * sum(g*xhat)/n)
//   dgamma[c] = sum over this rank's samples and space of dy*xhat, dbeta[c] = sum of dy: this
//   rank's channels only, so no further communication.
//   InstanceNorm is GroupNorm with G = C (one channel per group, never spanning ranks).
//
// Collectives: exactly ONE all_reduce_sum per forward and per backward. Its payload carries
// the partials of EVERY (sample, group), N * G * 2 values (+ the call header H = 10 or 2, and at
// P > 1 the slice table: every rank's [offset, offset + C_local), 2P values), of the wire type
// (float64 robust / float32 naive), zeros for groups this rank holds no channel of; Stats::kExact sends N * G * 13 int64 forward and N * G * 11 backward (the integer sums
// that give the same bits at every world size, see tpnorm/norm.h). Cost: each rank sends about P
// times the values it owns (a rank touches roughly G/P + 1 groups), in exchange for one
// latency-bound collective whose layout is the same on every rank. Sending only touched groups
// would need per-group sub-communicators or point-to-point messages (many latency-bound steps), and
// N*G*2 values are small next to the activations (N = 32, G = 32: 16 KiB in float64).
//
// Ranks must agree on N, C, G, S, dtype, eps, the stats mode and gamma/beta presence. The
// slices must tile [0, C): no gap, no overlap, in any order (checked on the summed slice table,
// the same tpnorm::Error on every rank otherwise; on device communicators only their channel
// counts are checked so far). slice_offset (tpnorm/communicator.h) gives consecutive slices in
// rank order from each rank's C_local. dtypes: x, y,
// dy, dx, gamma, beta, dgamma, dbeta share one storage dtype (fp32, fp16, bf16, or fp64 as in
// tpnorm/norm.h); mean / rstd
// float32 or float64 [N, G] (all groups, the same on every rank). Errors: tpnorm::Error on every
// rank together (tpnorm/error.h).
#pragma once

#include <cstdint>

#include "tpnorm/communicator.h"
#include "tpnorm/norm.h"
#include "tpnorm/tensor.h"

namespace tpnorm {

/// Where this rank's channels sit among all channels, and the grouping.
struct ChannelGroups {
  int64_t groups = 1;          ///< G; divides channels
  int64_t channels = -1;       ///< C over all ranks; -1: this rank's C_local (unsharded)
  int64_t channel_offset = 0;  ///< first channel of this rank's slice
};

/// GroupNorm forward.
/// [in]  x            [N, C_local, *spatial]
/// [in]  gamma, beta  [C_local] or absent (affine off)
/// [out] y            like x
/// [out] mean, rstd   [N, G] (numel N*G) float32/float64 or absent: every group's statistics
void group_norm_forward(Communicator& comm, const TensorView& x, const ChannelGroups& cg,
                        const TensorView& gamma, const TensorView& beta, const TensorView& y,
                        const TensorView& mean, const TensorView& rstd,
                        const NormOptions& opt = {});

/// GroupNorm backward. mean / rstd as written by group_norm_forward.
/// [out] dx like x; dgamma, dbeta [C_local] or absent: sums over this rank's samples and space
void group_norm_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                         const ChannelGroups& cg, const TensorView& gamma, const TensorView& mean,
                         const TensorView& rstd, const TensorView& dx, const TensorView& dgamma,
                         const TensorView& dbeta, const NormOptions& opt = {});

/// InstanceNorm: GroupNorm with one group per channel (cg.groups is ignored). mean / rstd are
/// [N, C].
void instance_norm_forward(Communicator& comm, const TensorView& x, const ChannelGroups& cg,
                           const TensorView& gamma, const TensorView& beta, const TensorView& y,
                           const TensorView& mean, const TensorView& rstd,
                           const NormOptions& opt = {});
void instance_norm_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                            const ChannelGroups& cg, const TensorView& gamma,
                            const TensorView& mean, const TensorView& rstd, const TensorView& dx,
                            const TensorView& dgamma, const TensorView& dbeta,
                            const NormOptions& opt = {});

}  // namespace tpnorm
