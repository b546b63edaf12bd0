// fused_cuda.cpp — see fused_cuda.h.
#include "ops/cuda/fused_cuda.h"

#include "common/cuda_check.h"
#include "common/dispatch.h"
#include "kernels/cuda/residual.h"
#include "ops/cuda/device_call.h"

namespace tpnorm::detail {

void residual_add_cuda(DeviceCommunicator& dev, const TensorView& x, const TensorView& f,
                       double alpha, const TensorView& h) {
  DeviceGuard guard(dev.device_index());
  dispatch_device_storage(x.dtype, [&](auto t) {
    using T = decltype(t);
    kernels::cuda::residual_add<T>(x.shape.numel(), static_cast<const T*>(x.data),
                                   static_cast<const T*>(f.data), static_cast<float>(alpha),
                                   static_cast<T*>(h.data), dev.stream());
  });
}

void residual_epilogue_cuda(PackedCall& call, DeviceCommunicator& dev, const TensorView& dh_extra,
                            double alpha, const TensorView& df, const TensorView& dx,
                            const NormOptions& opt) {
  DeviceGuard guard(dev.device_index());
  dispatch_device_storage(df.dtype, [&](auto t) {
    using T = decltype(t);
    kernels::cuda::residual_backward_epilogue<T>(
        device_header(call, dev, hidden_want(opt)), df.shape.numel(), static_cast<const T*>(dh_extra.data), static_cast<float>(alpha),
        static_cast<T*>(df.data), static_cast<T*>(dx.data), dev.stream());
  });
}

}  // namespace tpnorm::detail
