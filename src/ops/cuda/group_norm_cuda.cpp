// group_norm_cuda.cpp — see group_norm_cuda.h.
#include "ops/cuda/group_norm_cuda.h"

#include <algorithm>
#include <cstdint>

#include "common/dispatch.h"
#include "kernels/cuda/exact_groups.h"
#include "kernels/cuda/group_norm.h"
#include "ops/cuda/device_call.h"

namespace tpnorm::detail {
namespace {

namespace kcu = kernels::cuda;

kcu::GroupArgs device_args(const kernels::cpu::GroupNormArgs& k, int64_t channels, bool s64,
                           void* stream) {
  kcu::GroupArgs a;
  a.n = k.n;
  a.c_local = k.c_local;
  a.spatial = k.spatial;
  a.c0 = k.c0;
  a.groups = k.groups;
  a.cpg = k.cpg;
  a.channels = channels;
  a.s64 = s64;
  a.stream = stream;
  return a;
}

}  // namespace

size_t group_scratch_cuda(const kernels::cpu::GroupNormArgs& k) {
  const kcu::GroupArgs a = device_args(k, 0, false, nullptr);
  return std::max(kcu::group_scratch_bytes(a), kcu::exact_group_scratch_bytes(a));
}

void group_forward_partial_cuda(PackedCall& call, DeviceCommunicator& dev,
                                const kernels::cpu::GroupNormArgs& k, const TensorView& x,
                                const NormOptions& opt) {
  DeviceGuard guard(dev.device_index());
  const kcu::GroupArgs a = device_args(k, 0, false, dev.stream());
  dispatch_device_storage(x.dtype, [&](auto t) {
    using T = decltype(t);
    if (call.wire() == DType::I64)  // Stats::kExact (kernels/cuda/exact_groups.h)
      return kcu::exact_group_partial_forward<T>(a, static_cast<const T*>(x.data),
                                                 call.payload<int64_t>());
    kcu::group_partial_forward<T>(a, static_cast<const T*>(x.data), opt.stats == Stats::kRobust,
                                  call.wire() == DType::F64, call.payload_data(), call.scratch());
  });
}

void group_forward_apply_cuda(PackedCall& call, DeviceCommunicator& dev,
                              const kernels::cpu::GroupNormArgs& k, int64_t channels, double count,
                              const TensorView& x, const TensorView& gamma, const TensorView& beta,
                              const TensorView& y, const TensorView& mean, const TensorView& rstd,
                              const NormOptions& opt) {
  DeviceGuard guard(dev.device_index());
  const DType saved = rstd.present() ? rstd.dtype : (mean.present() ? mean.dtype : DType::F32);
  const kcu::GroupArgs a = device_args(k, channels, saved == DType::F64, dev.stream());
  dispatch_device_storage(x.dtype, [&](auto t) {
    using T = decltype(t);
    if (call.wire() == DType::I64)
      return kcu::exact_group_apply_forward<T>(
          a, device_header(call, dev), count, opt.eps, static_cast<const T*>(x.data),
          static_cast<const T*>(gamma.data), static_cast<const T*>(beta.data),
          static_cast<T*>(y.data), mean.data, rstd.data, dev.error_word());
    kcu::group_apply_forward<T>(a, device_header(call, dev), count, opt.eps,
                                static_cast<const T*>(x.data), static_cast<const T*>(gamma.data),
                                static_cast<const T*>(beta.data), static_cast<T*>(y.data),
                                mean.data, rstd.data, call.scratch(), dev.error_word());
  });
}

void group_backward_partial_cuda(PackedCall& call, DeviceCommunicator& dev,
                                 const kernels::cpu::GroupNormArgs& k, const TensorView& dy,
                                 const TensorView& x, const TensorView& gamma,
                                 const TensorView& mean, const TensorView& rstd) {
  DeviceGuard guard(dev.device_index());
  const kcu::GroupArgs a = device_args(k, 0, rstd.dtype == DType::F64, dev.stream());
  dispatch_device_storage(x.dtype, [&](auto t) {
    using T = decltype(t);
    if (call.wire() == DType::I64)
      return kcu::exact_group_partial_backward<T>(
          a, static_cast<const T*>(dy.data), static_cast<const T*>(x.data),
          static_cast<const T*>(gamma.data), mean.data, rstd.data, call.payload<int64_t>(),
          static_cast<double*>(call.scratch()));
    kcu::group_partial_backward<T>(a, static_cast<const T*>(dy.data), static_cast<const T*>(x.data),
                                   static_cast<const T*>(gamma.data), mean.data, rstd.data,
                                   call.wire() == DType::F64, call.payload_data(), call.scratch());
  });
}

void group_backward_apply_cuda(PackedCall& call, DeviceCommunicator& dev,
                               const kernels::cpu::GroupNormArgs& k, int64_t channels, double count,
                               const TensorView& dy, const TensorView& x, const TensorView& gamma,
                               const TensorView& mean, const TensorView& rstd, const TensorView& dx,
                               const TensorView& dgamma, const TensorView& dbeta) {
  DeviceGuard guard(dev.device_index());
  const kcu::GroupArgs a = device_args(k, channels, rstd.dtype == DType::F64, dev.stream());
  dispatch_device_storage(x.dtype, [&](auto t) {
    using T = decltype(t);
    if (call.wire() == DType::I64)
      return kcu::exact_group_apply_backward<T>(
          a, device_header(call, dev), count, static_cast<const T*>(dy.data),
          static_cast<const T*>(x.data), static_cast<const T*>(gamma.data), mean.data, rstd.data,
          static_cast<T*>(dx.data), static_cast<T*>(dgamma.data), static_cast<T*>(dbeta.data),
          static_cast<const double*>(call.scratch()), dev.error_word());
    kcu::group_apply_backward<T>(a, device_header(call, dev), count, static_cast<const T*>(dy.data),
                                 static_cast<const T*>(x.data), static_cast<const T*>(gamma.data),
                                 mean.data, rstd.data, static_cast<T*>(dx.data),
                                 static_cast<T*>(dgamma.data), static_cast<T*>(dbeta.data),
                                 call.scratch(), dev.error_word());
  });
}

}  // namespace tpnorm::detail
