// tpnorm/rms_norm_gated.h — gated RMSNorm with grouped statistics (Mamba-2's RMSNormGated,
// transformers' MambaRMSNormGated), the channel dim sharded over the ranks.
//
// x and the gate z are [rows, c_local] (leading dims flattened into rows; the last dim is this
// rank's slice). This rank holds the contiguous channels [offset, offset + c_local) of `hidden`
// in all; the slices of all ranks must tile [0, hidden) (c_local may differ and may be 0).
// Channel c belongs to group c / group_size, so a group may lie inside one rank's slice, span
// several ranks, or straddle a boundary. With n = group_size and sums over a (row, group):
//
//   u = x * silu(z)   (gate first, norm_before_gate = false; u = x when z is absent)
//   u = x             (norm_before_gate = true)
//   rstd[r, g] = 1/sqrt(sum(u^2)/n + eps)      uhat = u * rstd
//   y = uhat * w                (gate first)
//   y = uhat * w * silu(z)      (norm first)
//
// Backward, with sums over the (row, group) across ranks, s = silu(z), s' = s * (1 + z * (1 - s)):
//   gate first:  g = dy * w;     du = rstd * (g - uhat * sum(g*uhat)/n)
//                dx = du * s;    dz = du * x * s';   dw = sum over rows of dy * uhat
//   norm first:  g = dy * w * s; dx = rstd * (g - uhat * sum(g*uhat)/n)
//                dz = dy * w * uhat * s';            dw = sum over rows of dy * uhat * s
// dw is this rank's slice of dweight: no further communication.
//
// Collectives: exactly ONE all_reduce_sum per forward and per backward, whose payload carries
// one statistic of EVERY (row, group), rows * G values with G = hidden / group_size (+ the call
// header H = 10 or 2, see call_header_values), of the wire type: float64 for Stats::kRobust,
// float32 for Stats::kNaive; slots of groups this rank holds no channel of are zeros; at P > 1
// the slice table follows (every rank's [offset, offset + c_local), T = 2P values). Bytes sent
// per rank: 8 * (rows * G + H + T) robust, 4 * (rows * G + H + T) naive. When every group lies
// inside one rank (G a multiple of P with even slices) the statistics of other ranks are zeros
// and the call still makes its one collective: it checks the arguments agree on every rank and
// that the slices tile [0, hidden) with no gap and no overlap (on host communicators; on device
// ones only their channel counts so far). slice_offset (tpnorm/communicator.h) gives
// consecutive slices in rank order from each rank's c_local. Stats::kExact sends int64 limbs: 8 per (row, group) forward and 6
// backward (the integer sums of tpnorm/norm.h's RMSNorm): the same bits at every world size and
// split, for y, rstd, dx, dz and dweight.
//
// Ranks must agree on rows, hidden, group_size, norm_before_gate, dtype, eps, the stats mode and
// the presence of z and weight. dtypes: x, z, y, dy, dx, dz share one storage dtype (fp32, fp16,
// bf16, or fp64 with Stats::kRobust on CPU communicators); weight and dweight have x's dtype or
// float32 next to fp16/bf16 x (mixed precision); rstd is float32 or float64 [rows, G] (every
// group, the same on every rank). Computation is in float32 (float64 for fp64 storage). On device
// communicators (CUDA builds): Stats::kRobust and kNaive with weights in x's dtype; Stats::kExact
// fails there on every rank (CPU kernels only so far). Errors: tpnorm::Error on every rank
// together (tpnorm/error.h), outputs untouched.
#pragma once

#include <cstdint>

#include "tpnorm/communicator.h"
#include "tpnorm/norm.h"
#include "tpnorm/split.h"
#include "tpnorm/tensor.h"

namespace tpnorm {

/// Where this rank's channels sit among all channels, and the grouping.
struct GatedGroups {
  int64_t group_size = -1;        ///< channels per group, divides hidden; -1: hidden (one group)
  int64_t hidden = -1;            ///< channels over all ranks; -1: this rank's c_local (unsharded)
  int64_t offset = 0;             ///< first channel of this rank's slice
  bool norm_before_gate = false;  ///< mamba_ssm's flag: normalize x, then gate (see above)
};

/// Gated RMSNorm forward.
/// [in]  x       [rows, c_local]
/// [in]  z       [rows, c_local] like x, or absent (no gate: a grouped RMSNorm)
/// [in]  weight  [c_local] or absent (= 1)
/// [out] y       [rows, c_local] like x
/// [out] rstd    [rows, G] float32/float64, saved for backward; may be absent (inference)
void rms_norm_gated_forward(Communicator& comm, const TensorView& x, const TensorView& z,
                            const GatedGroups& gg, const TensorView& weight, const TensorView& y,
                            const TensorView& rstd, const NormOptions& opt = {});

/// Gated RMSNorm backward. rstd as written by rms_norm_gated_forward.
/// [out] dx like x; dz like z (required when z is present, absent otherwise)
/// [out] dweight [c_local] or absent: sums over this rank's rows (overwritten)
void rms_norm_gated_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                             const TensorView& z, const GatedGroups& gg, const TensorView& weight,
                             const TensorView& rstd, const TensorView& dx, const TensorView& dz,
                             const TensorView& dweight, const NormOptions& opt = {});

/// The split-phase forms (tpnorm/split.h): the call's collective in flight until finish().
[[nodiscard]] PendingCall rms_norm_gated_forward_start(Communicator& comm, const TensorView& x,
                                                       const TensorView& z, const GatedGroups& gg,
                                                       const TensorView& weight,
                                                       const TensorView& y, const TensorView& rstd,
                                                       const NormOptions& opt = {});
[[nodiscard]] PendingCall rms_norm_gated_backward_start(
    Communicator& comm, const TensorView& dy, const TensorView& x, const TensorView& z,
    const GatedGroups& gg, const TensorView& weight, const TensorView& rstd, const TensorView& dx,
    const TensorView& dz, const TensorView& dweight, const NormOptions& opt = {});

}  // namespace tpnorm
