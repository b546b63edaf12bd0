// batch_norm_cuda.h — the device hooks of the SyncBatchNorm specs (ops/batch_norm.cpp):
// training = partial kernels -> (run_op's ONE collective, PackedCall::reduce) -> per-channel
// constants, saved and running statistics -> apply; eval with running statistics makes no
// collective. Everything on the communicator's stream. Stats::kExact calls go to
// kernels/cuda/exact_channels.h (the CPU's limbs and bits) in each of the four hooks.
#pragma once

#include <cstddef>

#include "ops/batch_norm_stages.h"
#include "ops/packed_call.h"

namespace tpnorm::detail {

/// Device scratch bytes of one call of geometry `a`.
size_t bn_scratch_cuda(const kernels::cpu::BatchNormArgs& a);

/// `call` is on the communicator when the call is collective (f.batch_stats, b.opt.training),
/// else a local host call that only holds this rank's validation and, as scratch(), its own
/// region of the communicator's workspace (PackedCall::prepare_local_scratch).
void bn_forward_partial_cuda(PackedCall& call, DeviceCommunicator& dev, const BnForward& f);
void bn_forward_apply_cuda(PackedCall& call, DeviceCommunicator& dev, const BnForward& f);
void bn_backward_partial_cuda(PackedCall& call, DeviceCommunicator& dev, const BnBackward& b);
void bn_backward_apply_cuda(PackedCall& call, DeviceCommunicator& dev, const BnBackward& b);

}  // namespace tpnorm::detail
