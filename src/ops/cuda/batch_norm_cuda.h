// batch_norm_cuda.h — the device path of SyncBatchNorm (ops/batch_norm.cpp validates, then
// hands a call on a CUDA communicator here): training = partial kernels -> the ONE collective
// (PackedCall::reduce) -> per-channel constants, saved and running statistics -> apply; eval
// with running statistics makes no collective. Everything on the communicator's stream.
#pragma once

#include "kernels/cpu/batch_norm.h"
#include "ops/packed_call.h"
#include "tpnorm/batch_norm.h"

namespace tpnorm::detail {

/// `call` is on `comm` when batch_stats (training, or eval without running statistics), else a
/// local host call that only holds this rank's validation. `a` is the op's geometry.
void sync_batch_norm_forward_cuda(Communicator& comm, PackedCall& call,
                                  const kernels::cpu::BatchNormArgs& a, bool batch_stats,
                                  bool tracking, const TensorView& x, const TensorView& gamma,
                                  const TensorView& beta, const TensorView& running_mean,
                                  const TensorView& running_var, int64_t* num_batches_tracked,
                                  const TensorView& y, const TensorView& save_mean,
                                  const TensorView& save_invstd, const BatchNormOptions& opt);

void sync_batch_norm_backward_cuda(Communicator& comm, PackedCall& call,
                                   const kernels::cpu::BatchNormArgs& a, const TensorView& dy,
                                   const TensorView& x, const TensorView& gamma,
                                   const TensorView& save_mean, const TensorView& save_invstd,
                                   const TensorView& dx, const TensorView& dgamma,
                                   const TensorView& dbeta, const BatchNormOptions& opt);

}  // namespace tpnorm::detail
