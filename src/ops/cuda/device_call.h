// device_call.h — what the device paths of the ops share around PackedCall: the payload
// pointer and the summed header as the kernels see them, and the rule that nothing before
// the collective may keep a rank out of it.
//
// Between PackedCall's construction and reduce() a device op only records failures
// (call.fail): a failed cudaSetDevice, a partial kernel that did not launch, or any other
// exception becomes this rank's error flag, the rank still joins the one collective, every
// rank's apply kernels see the flag, and this rank throws afterwards (as on CPU). A workspace
// that cannot grow is the exception: in a strict call the host pre-check still makes every
// rank throw together; after the strict calls the rank cannot join a collective of the
// others' length, so it ends the job (DeviceCommunicator::abort_job) instead of stranding them.
#pragma once

#include <exception>
#include <optional>
#include <string>

#include "common/cuda_check.h"
#include "kernels/cuda/row_norm.h"
#include "ops/packed_call.h"

namespace tpnorm::detail {

inline void* device_payload(PackedCall& call) {
  return call.wire() == DType::F64 ? static_cast<void*>(call.payload<double>())
                                   : static_cast<void*>(call.payload<float>());
}

/// The call's summed header as the apply kernels read it (valid after reduce()).
inline kernels::cuda::Header device_header(PackedCall& call, const Communicator& comm) {
  return {call.base(), static_cast<int>(call.header_values()), comm.size(),
          call.wire() == DType::F64};
}

/// Runs f(); any exception becomes the call's local failure instead of leaving the rank out
/// of the collective.
template <class F>
void before_collective(PackedCall& call, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    call.fail(e.what(), ErrorCode::kCommunication);
  }
}

/// Makes the communicator's device current for the scope of `g`, or records a failure.
inline void enter_device(PackedCall& call, DeviceCommunicator& dev,
                         std::optional<DeviceGuard>& g) {
  before_collective(call, [&] { g.emplace(dev.device_index()); });
}

/// PackedCall::prepare on the device workspace (see the header comment for a failure).
inline void prepare_device(PackedCall& call, Communicator& comm, DeviceCommunicator& dev,
                           size_t payload_values, double local_count, size_t scratch_bytes) {
  try {
    call.prepare(payload_values, local_count, scratch_bytes);
  } catch (const std::exception& e) {
    call.fail(std::string("the device workspace could not grow: ") + e.what(),
              ErrorCode::kCommunication);
    if (!comm.strict_now())
      dev.abort_job("tpnorm: rank " + std::to_string(comm.rank()) + " of " +
                    std::to_string(comm.size()) + ": cannot join the call's collective: " +
                    e.what() + "; ending the job (the other ranks would wait forever)");
  }
}

}  // namespace tpnorm::detail
