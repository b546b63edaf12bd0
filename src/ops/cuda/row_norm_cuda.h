// row_norm_cuda.h — the device hooks of the LayerNorm / RMSNorm specs (ops/row_norm.cpp):
// partial kernel -> (run_op's ONE collective, PackedCall::reduce) -> apply kernels, all on the
// communicator's stream. The partial kernel writes the call's header too
// (PackedCall::take_device_header), so no header kernel is launched; batched calls (the _at
// forms without a HeaderWrite) still get the header kernel.
#pragma once

#include <cstddef>

#include "kernels/cuda/call_header.h"
#include "ops/packed_call.h"
#include "ops/row_stages.h"

namespace tpnorm::detail {

void row_forward_partial_cuda(PackedCall& call, DeviceCommunicator& dev, const RowForwardCall& c);
void row_forward_apply_cuda(PackedCall& call, DeviceCommunicator& dev, const RowForwardCall& c);

/// Device scratch bytes of the backward (dgamma / dbeta column sums: written by the partial,
/// added up by the apply).
size_t row_backward_scratch_cuda(const RowBackwardCall& c);
void row_backward_partial_cuda(PackedCall& call, DeviceCommunicator& dev, const RowBackwardCall& c);
void row_backward_apply_cuda(PackedCall& call, DeviceCommunicator& dev, const RowBackwardCall& c);

/// The same stages at a given place of a call's buffer: `payload` for the partials, the
/// Header view (count slot and statistics slice) for the applies, and the backward's
/// `scratch` (row_backward_scratch_at bytes) for both. Batched calls (ops/batched.cpp) run
/// each item this way. Stats::kExact (an int64 header, Header::i64) runs the exact stages of
/// ops/cuda/exact_cuda.h.
void row_forward_partial_at(DeviceCommunicator& dev, const RowForward& a, Stats stats, bool w64,
                            void* payload, const kernels::cuda::HeaderWrite& hw = {});
void row_forward_apply_at(DeviceCommunicator& dev, const RowForward& a, double eps,
                          const kernels::cuda::Header& hd);
size_t row_backward_scratch_at(const RowBackward& a, Stats stats);
/// `accumulate` and `parts`: the row chunks of one call (row_chunks_cuda.h) add their column
/// sums into the same scratch slices, and the last chunk's apply adds `parts` of them
/// (kernels/cuda/row_norm.h); the defaults are the one-chunk call.
void row_backward_partial_at(DeviceCommunicator& dev, const RowBackward& a, Stats stats, bool w64,
                             void* payload, void* scratch,
                             const kernels::cuda::HeaderWrite& hw = {}, bool accumulate = false);
void row_backward_apply_at(DeviceCommunicator& dev, const RowBackward& a,
                           const kernels::cuda::Header& hd, void* scratch, int64_t parts = -1);

}  // namespace tpnorm::detail
