// fused_cuda.h — the device side of the fused residual add + row norm specs (ops/fused.cpp):
// the residual add before the row norm's partial (h = alpha*x + f, written before the
// collective, as on CPU), and the backward's epilogue after the row norm's apply
// (df = dnorm + dh_extra, dx = alpha*df). The row norm's own stages are row_norm_cuda.h's.
#pragma once

#include "comm/device_comm.h"
#include "ops/packed_call.h"
#include "tpnorm/norm.h"
#include "tpnorm/tensor.h"

namespace tpnorm::detail {

/// h = alpha*x + f over all elements of x, on dev's stream.
void residual_add_cuda(DeviceCommunicator& dev, const TensorView& x, const TensorView& f,
                       double alpha, const TensorView& h);

/// df = df + dh_extra (absent: + 0); dx = alpha*df, over all elements of df, when the call's
/// summed header accepts it (a rejected call leaves df and dx untouched).
void residual_epilogue_cuda(PackedCall& call, DeviceCommunicator& dev, const TensorView& dh_extra,
                            double alpha, const TensorView& df, const TensorView& dx,
                            const NormOptions& opt);

}  // namespace tpnorm::detail
