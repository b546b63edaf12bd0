// group_norm_cuda.h — the device stages of the GroupNorm / InstanceNorm specs
// (ops/group_norm.cpp): partial kernels -> (run_op's ONE collective) -> apply kernels, on the
// communicator's stream. The spec's geometry comes in as the CPU kernels' GroupNormArgs; the
// payload is the same per-(sample, group) layout, so the header and agreement are unchanged.
// On device the apply kernels check that the ranks' channel counts add up to `channels`.
#pragma once

#include <cstddef>

#include "kernels/cpu/group_norm.h"
#include "ops/packed_call.h"
#include "tpnorm/norm.h"

namespace tpnorm::detail {

/// Device scratch bytes of either pass.
size_t group_scratch_cuda(const kernels::cpu::GroupNormArgs& k);

void group_forward_partial_cuda(PackedCall& call, DeviceCommunicator& dev,
                                const kernels::cpu::GroupNormArgs& k, const TensorView& x,
                                const NormOptions& opt);
/// count: elements per group over all ranks; channels: all channels.
void group_forward_apply_cuda(PackedCall& call, DeviceCommunicator& dev,
                              const kernels::cpu::GroupNormArgs& k, int64_t channels, double count,
                              const TensorView& x, const TensorView& gamma, const TensorView& beta,
                              const TensorView& y, const TensorView& mean, const TensorView& rstd,
                              const NormOptions& opt);

void group_backward_partial_cuda(PackedCall& call, DeviceCommunicator& dev,
                                 const kernels::cpu::GroupNormArgs& k, const TensorView& dy,
                                 const TensorView& x, const TensorView& gamma,
                                 const TensorView& mean, const TensorView& rstd);
void group_backward_apply_cuda(PackedCall& call, DeviceCommunicator& dev,
                               const kernels::cpu::GroupNormArgs& k, int64_t channels, double count,
                               const TensorView& dy, const TensorView& x, const TensorView& gamma,
                               const TensorView& mean, const TensorView& rstd, const TensorView& dx,
                               const TensorView& dgamma, const TensorView& dbeta);

}  // namespace tpnorm::detail
