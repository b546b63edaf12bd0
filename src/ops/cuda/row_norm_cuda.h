// row_norm_cuda.h — the device path of the LayerNorm / RMSNorm pipelines (ops/row_norm.cpp
// validates, then hands a call on a device communicator here): partial kernel -> the ONE
// collective (PackedCall::reduce) -> apply kernels, all on the communicator's stream.
#pragma once

#include "ops/packed_call.h"
#include "tpnorm/norm.h"

namespace tpnorm::detail {

void row_forward_cuda(PackedCall& call, bool centered, int64_t rows, int64_t h,
                      const TensorView& x, const TensorView& gamma, const TensorView& beta,
                      const TensorView& y, const TensorView& mean, const TensorView& rstd,
                      const NormOptions& opt);

void row_backward_cuda(PackedCall& call, bool centered, int64_t rows, int64_t h,
                       const TensorView& dy, const TensorView& x, const TensorView& gamma,
                       const TensorView& mean, const TensorView& rstd, const TensorView& dx,
                       const TensorView& dgamma, const TensorView& dbeta);

}  // namespace tpnorm::detail
