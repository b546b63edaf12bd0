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

namespace tpnorm::detail {

/// The call's summed header as the apply kernels read it (valid after reduce()).
inline kernels::cuda::Header device_header(PackedCall& call, const Communicator& comm) {
  return {call.base(), static_cast<int>(call.header_values()), comm.size(),
          call.wire() != DType::F32, call.wire() == DType::I64};
}

/// The kernels' name of the call's wire type.
inline kernels::cuda::Wire device_wire(DType wire) {
  using kernels::cuda::Wire;
  return wire == DType::I64 ? Wire::kI64 : wire == DType::F64 ? Wire::kF64 : Wire::kF32;
}

}  // namespace tpnorm::detail
