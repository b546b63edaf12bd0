// rms_norm_gated_cuda.h — the device stages of the gated RMSNorm specs (ops/rms_norm_gated.cpp):
// partial kernels -> (run_op's ONE collective) -> apply kernels, on the communicator's stream.
// The spec's geometry comes in as the CPU kernels' GatedArgs; the payload is the same
// per-(row, group) layout, so the header and agreement are unchanged. On device the apply
// kernels check that the ranks' channel counts add up to `hidden`.
#pragma once

#include <cstddef>

#include "kernels/cpu/rms_norm_gated.h"
#include "ops/packed_call.h"
#include "tpnorm/norm.h"

namespace tpnorm::detail {

/// Device scratch bytes of either pass.
size_t gated_scratch_cuda(const kernels::cpu::GatedArgs& k);

void gated_forward_partial_cuda(PackedCall& call, DeviceCommunicator& dev,
                                const kernels::cpu::GatedArgs& k, const TensorView& x,
                                const TensorView& z);
/// hidden: all channels.
void gated_forward_apply_cuda(PackedCall& call, DeviceCommunicator& dev,
                              const kernels::cpu::GatedArgs& k, int64_t hidden, const TensorView& x,
                              const TensorView& z, const TensorView& weight, const TensorView& y,
                              const TensorView& rstd, const NormOptions& opt);

void gated_backward_partial_cuda(PackedCall& call, DeviceCommunicator& dev,
                                 const kernels::cpu::GatedArgs& k, const TensorView& dy,
                                 const TensorView& x, const TensorView& z, const TensorView& weight,
                                 const TensorView& rstd, const TensorView& dweight);
void gated_backward_apply_cuda(PackedCall& call, DeviceCommunicator& dev,
                               const kernels::cpu::GatedArgs& k, int64_t hidden,
                               const TensorView& dy, const TensorView& x, const TensorView& z,
                               const TensorView& weight, const TensorView& rstd,
                               const TensorView& dx, const TensorView& dz,
                               const TensorView& dweight);

}  // namespace tpnorm::detail
