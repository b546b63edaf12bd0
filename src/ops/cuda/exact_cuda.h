// exact_cuda.h — the device stages of Stats::kExact (kernels/cuda/exact_*.h). The row hooks
// (ops/cuda/row_norm_cuda.cpp, whose *_at forms serve the row norms, the fused residual norms
// and the batched norms) hand an exact call to these: the partials write int64 limbs (the
// CPU's layout), the applies finish them into final statistics and apply the CPU's formulas.
#pragma once

#include <cstddef>

#include "kernels/cuda/call_header.h"
#include "ops/row_stages.h"

namespace tpnorm::detail {

void exact_row_forward_partial_at(DeviceCommunicator& dev, const RowForward& a, void* payload);
void exact_row_forward_apply_at(DeviceCommunicator& dev, const RowForward& a, double eps,
                                const kernels::cuda::Header& hd);
size_t exact_row_backward_scratch_at(const RowBackward& a);
void exact_row_backward_partial_at(DeviceCommunicator& dev, const RowBackward& a, void* payload);
void exact_row_backward_apply_at(DeviceCommunicator& dev, const RowBackward& a,
                                 const kernels::cuda::Header& hd, void* scratch);

}  // namespace tpnorm::detail
