// device_call.h — what the device hooks of the ops share around PackedCall: the summed header
// as the apply kernels see it. The rule that nothing before the collective may keep a rank out
// of it (a failed cudaSetDevice, a partial kernel that did not launch, a workspace that cannot
// grow) is run_op's (ops/run_op.cpp): such a failure becomes this rank's error flag, the rank
// still joins the one collective, every rank's apply kernels see the flag, and this rank throws
// afterwards (as on CPU).
#pragma once

#include "common/cuda_check.h"
#include "kernels/cuda/row_norm.h"
#include "ops/packed_call.h"
#include "tpnorm/norm.h"

namespace tpnorm::detail {

/// The call's summed header as the apply kernels read it (valid after reduce()); count_want >= 0:
/// the summed count the kernels require (a row norm's hidden size), else any.
inline kernels::cuda::Header device_header(PackedCall& call, const Communicator& comm,
                                           double count_want = -1) {
  kernels::cuda::Header hd{call.base(), static_cast<int>(call.header_values()), comm.size(),
                           call.wire() != DType::F32, call.wire() == DType::I64};
  hd.count_want = count_want;
  return hd;
}

/// The count a row norm's apply kernels require: NormOptions::hidden_size when given.
inline double hidden_want(const NormOptions& opt) {
  return opt.hidden_size > 0 ? static_cast<double>(opt.hidden_size) : -1;
}

/// The kernels' name of the call's wire type.
inline kernels::cuda::Wire device_wire(DType wire) {
  using kernels::cuda::Wire;
  return wire == DType::I64 ? Wire::kI64 : wire == DType::F64 ? Wire::kF64 : Wire::kF32;
}

}  // namespace tpnorm::detail
