// row_norm_cuda.h — the device hooks of the LayerNorm / RMSNorm specs (ops/row_norm.cpp):
// partial kernel -> (run_op's ONE collective, PackedCall::reduce) -> apply kernels, all on the
// communicator's stream.
#pragma once

#include <cstddef>

#include "ops/packed_call.h"
#include "ops/row_stages.h"

namespace tpnorm::detail {

void row_forward_partial_cuda(PackedCall& call, DeviceCommunicator& dev, const RowForwardCall& c);
void row_forward_apply_cuda(PackedCall& call, DeviceCommunicator& dev, const RowForwardCall& c);

/// Device scratch bytes of the backward apply (dgamma / dbeta partials).
size_t row_backward_scratch_cuda(const RowBackwardCall& c);
void row_backward_partial_cuda(PackedCall& call, DeviceCommunicator& dev, const RowBackwardCall& c);
void row_backward_apply_cuda(PackedCall& call, DeviceCommunicator& dev, const RowBackwardCall& c);

}  // namespace tpnorm::detail
