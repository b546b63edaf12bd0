// row_norm_cuda.cpp — see row_norm_cuda.h. Nothing here synchronises the host or allocates
// once the communicator's workspace is large enough (PackedCall::prepare grows it); a call's
// header (error flag, count, fingerprint) is checked on device by the apply kernels.
#include "ops/cuda/row_norm_cuda.h"

#include "common/dispatch.h"
#include "kernels/cuda/row_norm.h"
#include "ops/cuda/device_call.h"

namespace tpnorm::detail {
namespace {
namespace kcu = kernels::cuda;
}  // namespace

void row_forward_cuda(PackedCall& call, bool centered, int64_t rows, int64_t h,
                      const TensorView& x, const TensorView& gamma, const TensorView& beta,
                      const TensorView& y, const TensorView& mean, const TensorView& rstd,
                      const NormOptions& opt) {
  DeviceCommunicator& comm = *call.device_comm();
  std::optional<DeviceGuard> guard;
  enter_device(call, comm, guard);
  const int per_row = centered ? 2 : 1;
  prepare_device(call, comm, comm, static_cast<size_t>(rows > 0 ? rows * per_row : 0),
                 static_cast<double>(h), 0);
  const DType sdt = rstd.present() ? rstd.dtype : (mean.present() ? mean.dtype : DType::F32);
  const kcu::RowArgs a{rows, h, centered, sdt == DType::F64, comm.stream()};
  if (!call.failed()) {
    before_collective(call, [&] {
      dispatch_storage(x.dtype, [&](auto t) {
        using T = decltype(t);
        kcu::row_partial_forward<T>(a, static_cast<const T*>(x.data),
                                    opt.stats == Stats::kRobust, call.wire() == DType::F64,
                                    device_payload(call));
      });
    });
  }
  call.reduce();
  dispatch_storage(x.dtype, [&](auto t) {
    using T = decltype(t);
    kcu::row_apply_forward<T>(a, static_cast<const T*>(x.data), static_cast<const T*>(gamma.data),
                              static_cast<const T*>(beta.data), device_header(call, comm),
                              opt.eps, static_cast<T*>(y.data), centered ? mean.data : nullptr,
                              rstd.data, comm.error_word());
  });
}

void row_backward_cuda(PackedCall& call, bool centered, int64_t rows, int64_t h,
                       const TensorView& dy, const TensorView& x, const TensorView& gamma,
                       const TensorView& mean, const TensorView& rstd, const TensorView& dx,
                       const TensorView& dgamma, const TensorView& dbeta) {
  DeviceCommunicator& comm = *call.device_comm();
  std::optional<DeviceGuard> guard;
  enter_device(call, comm, guard);
  const int per_row = centered ? 2 : 1;
  const bool params = dgamma.present() || (centered && dbeta.present());
  prepare_device(call, comm, comm, static_cast<size_t>(rows > 0 ? rows * per_row : 0),
                 static_cast<double>(h),
                 call.failed() ? 0 : kcu::row_norm_scratch_bytes(rows, h, params));
  const kcu::RowArgs a{rows, h, centered, rstd.dtype == DType::F64, comm.stream()};
  const void* m = centered ? mean.data : nullptr;
  if (!call.failed()) {
    before_collective(call, [&] {
      dispatch_storage(x.dtype, [&](auto t) {
        using T = decltype(t);
        kcu::row_partial_backward<T>(a, static_cast<const T*>(dy.data),
                                     static_cast<const T*>(x.data),
                                     static_cast<const T*>(gamma.data), m, rstd.data,
                                     call.wire() == DType::F64, device_payload(call));
      });
    });
  }
  call.reduce();
  dispatch_storage(x.dtype, [&](auto t) {
    using T = decltype(t);
    kcu::row_apply_backward<T>(a, static_cast<const T*>(dy.data), static_cast<const T*>(x.data),
                               static_cast<const T*>(gamma.data), m, rstd.data,
                               device_header(call, comm), static_cast<T*>(dx.data),
                               static_cast<T*>(dgamma.data),
                               centered ? static_cast<T*>(dbeta.data) : nullptr, call.scratch(),
                               comm.error_word());
  });
}

}  // namespace tpnorm::detail
