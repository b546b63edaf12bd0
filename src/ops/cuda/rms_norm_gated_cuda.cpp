// rms_norm_gated_cuda.cpp — see rms_norm_gated_cuda.h.
#include "ops/cuda/rms_norm_gated_cuda.h"

#include <cstdint>

#include "common/dispatch.h"
#include "kernels/cuda/rms_norm_gated.h"
#include "ops/cuda/device_call.h"

namespace tpnorm::detail {
namespace {

namespace kcu = kernels::cuda;

kcu::GatedArgs device_args(const kernels::cpu::GatedArgs& k, int64_t hidden, bool s64,
                           void* stream) {
  kcu::GatedArgs a;
  a.rows = k.rows;
  a.c_local = k.c_local;
  a.c0 = k.c0;
  a.group_size = k.group_size;
  a.groups = k.groups;
  a.hidden = hidden;
  a.norm_before_gate = k.norm_before_gate;
  a.s64 = s64;
  a.stream = stream;
  return a;
}

}  // namespace

size_t gated_scratch_cuda(const kernels::cpu::GatedArgs& k) {
  return kcu::gated_scratch_bytes(device_args(k, 0, false, nullptr));
}

void gated_forward_partial_cuda(PackedCall& call, DeviceCommunicator& dev,
                                const kernels::cpu::GatedArgs& k, const TensorView& x,
                                const TensorView& z) {
  DeviceGuard guard(dev.device_index());
  const kcu::GatedArgs a = device_args(k, 0, false, dev.stream());
  dispatch_device_storage(x.dtype, [&](auto t) {
    using T = decltype(t);
    kcu::gated_partial_forward<T>(a, static_cast<const T*>(x.data), static_cast<const T*>(z.data),
                                  call.wire() == DType::F64, call.payload_data());
  });
}

void gated_forward_apply_cuda(PackedCall& call, DeviceCommunicator& dev,
                              const kernels::cpu::GatedArgs& k, int64_t hidden, const TensorView& x,
                              const TensorView& z, const TensorView& weight, const TensorView& y,
                              const TensorView& rstd, const NormOptions& opt) {
  DeviceGuard guard(dev.device_index());
  const bool s64 = rstd.present() && rstd.dtype == DType::F64;
  const kcu::GatedArgs a = device_args(k, hidden, s64, dev.stream());
  dispatch_device_storage(x.dtype, [&](auto t) {
    using T = decltype(t);
    kcu::gated_apply_forward<T>(a, device_header(call, dev), opt.eps, static_cast<const T*>(x.data),
                                static_cast<const T*>(z.data), static_cast<const T*>(weight.data),
                                static_cast<T*>(y.data), rstd.data, dev.error_word());
  });
}

void gated_backward_partial_cuda(PackedCall& call, DeviceCommunicator& dev,
                                 const kernels::cpu::GatedArgs& k, const TensorView& dy,
                                 const TensorView& x, const TensorView& z, const TensorView& weight,
                                 const TensorView& rstd, const TensorView& dweight) {
  DeviceGuard guard(dev.device_index());
  const kcu::GatedArgs a = device_args(k, 0, rstd.dtype == DType::F64, dev.stream());
  dispatch_device_storage(x.dtype, [&](auto t) {
    using T = decltype(t);
    kcu::gated_partial_backward<T>(
        a, static_cast<const T*>(dy.data), static_cast<const T*>(x.data),
        static_cast<const T*>(z.data), static_cast<const T*>(weight.data), rstd.data,
        call.wire() == DType::F64, call.payload_data(), dweight.present(), call.scratch());
  });
}

void gated_backward_apply_cuda(PackedCall& call, DeviceCommunicator& dev,
                               const kernels::cpu::GatedArgs& k, int64_t hidden,
                               const TensorView& dy, const TensorView& x, const TensorView& z,
                               const TensorView& weight, const TensorView& rstd,
                               const TensorView& dx, const TensorView& dz,
                               const TensorView& dweight) {
  DeviceGuard guard(dev.device_index());
  const kcu::GatedArgs a = device_args(k, hidden, rstd.dtype == DType::F64, dev.stream());
  dispatch_device_storage(x.dtype, [&](auto t) {
    using T = decltype(t);
    kcu::gated_apply_backward<T>(a, device_header(call, dev), static_cast<const T*>(dy.data),
                                 static_cast<const T*>(x.data), static_cast<const T*>(z.data),
                                 static_cast<const T*>(weight.data), rstd.data,
                                 static_cast<T*>(dx.data), static_cast<T*>(dz.data),
                                 static_cast<T*>(dweight.data), call.scratch(), dev.error_word());
  });
}

}  // namespace tpnorm::detail
