// cuda_check.h — the CUDA and NCCL overloads of the TPNORM_CHECK family (common/check.h), and
// the scope that makes a communicator's device current. Shared by the CUDA kernels' launchers
// (kernels/cuda/launch.cuh checks each launch), the device communicators and the ops; it
// includes nothing of either layer.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "common/check.h"

#ifdef TPNORM_WITH_NCCL
#include <nccl.h>
#endif

namespace tpnorm::detail {

inline bool CUDA_ok(cudaError_t e) { return e == cudaSuccess; }
inline std::string CUDA_error_string(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}
#ifdef TPNORM_WITH_NCCL
inline bool NCCL_ok(ncclResult_t r) { return r == ncclSuccess; }
inline std::string NCCL_error_string(ncclResult_t r) {
  return std::string(ncclGetErrorString(r)) + " (" + std::to_string(static_cast<int>(r)) + ")";
}
#endif

}  // namespace tpnorm::detail

namespace tpnorm::detail {

/// Makes `device` current for a scope and restores the caller's device after: tpnorm never
/// leaves the caller's current device changed.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    TPNORM_CHECK(CUDA, cudaGetDevice(&prev_));
    if (prev_ != device) TPNORM_CHECK(CUDA, cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int now = prev_;
    if (cudaGetDevice(&now) == cudaSuccess && now != prev_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

}  // namespace tpnorm::detail
