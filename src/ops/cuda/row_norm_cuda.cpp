// row_norm_cuda.cpp — see row_norm_cuda.h. Nothing here synchronises the host or allocates
// once the communicator's workspace is large enough (PackedCall::prepare grows it); a call's
// header (error flag, count, fingerprint) is checked on device by the apply kernels.
#include "ops/cuda/row_norm_cuda.h"

#include <type_traits>

#include "common/dispatch.h"
#include "kernels/cuda/row_norm.h"
#include "ops/cuda/device_call.h"
#include "ops/cuda/exact_cuda.h"

namespace tpnorm::detail {
namespace {

namespace kcu = kernels::cuda;

// fn(RowArgs, const T* x) with T the storage type of the call, on the communicator's device.
template <class Fn>
void forward_kernel(DeviceCommunicator& dev, const RowForward& a, Fn&& fn) {
  DeviceGuard guard(dev.device_index());
  const bool s64 = saved_dtype(a.mean, a.rstd) == DType::F64;
  const kcu::RowArgs k{a.g.rows, a.g.h, a.centered, s64, dev.stream()};
  dispatch_device_storage(a.x.dtype, [&](auto t) { fn(k, static_cast<const decltype(t)*>(a.x.data)); });
}

// The backward's inputs, typed: what its partial and apply kernels both read.
template <class T>
struct BackwardIn {
  const T* dy;
  const T* x;
  const T* gamma;
  const void* mean;  // null for RMSNorm
  const void* rstd;
};

// fn(RowArgs, BackwardIn<T>) with T the storage type of the call.
template <class Fn>
void backward_kernel(DeviceCommunicator& dev, const RowBackward& a, Fn&& fn) {
  DeviceGuard guard(dev.device_index());
  const kcu::RowArgs k{a.g.rows, a.g.h, a.centered, a.rstd.dtype == DType::F64, dev.stream()};
  dispatch_device_storage(a.x.dtype, [&](auto t) {
    using T = decltype(t);
    fn(k, BackwardIn<T>{static_cast<const T*>(a.dy.data), static_cast<const T*>(a.x.data),
                        static_cast<const T*>(a.gamma.data), a.centered ? a.mean.data : nullptr,
                        a.rstd.data});
  });
}

// This rank's header for the partial kernel to write (nothing when the call failed already).
kcu::HeaderWrite header_for_partial(PackedCall& call) {
  kcu::HeaderWrite hw;
  // Stats::kExact's int64 header is left to the header kernel: the exact partials write none.
  if (call.wire() == DType::I64) return hw;
  if (!call.take_device_header(hw.v)) return hw;
  hw.base = call.base();
  hw.w64 = call.wire() == DType::F64;
  hw.nh = static_cast<int>(call.header_values());
  return hw;
}

}  // namespace

void row_forward_partial_at(DeviceCommunicator& dev, const RowForward& a, Stats stats, bool w64,
                            void* payload, const kcu::HeaderWrite& hw) {
  if (stats == Stats::kExact) return exact_row_forward_partial_at(dev, a, payload);
  forward_kernel(dev, a, [&](const kcu::RowArgs& k, auto x) {
    kcu::row_partial_forward(k, x, stats == Stats::kRobust, w64, payload, hw);
  });
}

void row_forward_apply_at(DeviceCommunicator& dev, const RowForward& a, double eps,
                          const kcu::Header& hd) {
  if (hd.i64) return exact_row_forward_apply_at(dev, a, eps, hd);
  forward_kernel(dev, a, [&](const kcu::RowArgs& k, auto x) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(x)>>;
    kcu::row_apply_forward(k, x, static_cast<const T*>(a.gamma.data),
                           static_cast<const T*>(a.beta.data), hd, eps, static_cast<T*>(a.y.data),
                           a.centered ? a.mean.data : nullptr, a.rstd.data, dev.error_word());
  });
}

size_t row_backward_scratch_at(const RowBackward& a, Stats stats) {
  if (stats == Stats::kExact) return exact_row_backward_scratch_at(a);
  const bool params = a.dgamma.present() || (a.centered && a.dbeta.present());
  return kcu::row_norm_scratch_bytes(a.g.rows, a.g.h, params);
}

void row_backward_partial_at(DeviceCommunicator& dev, const RowBackward& a, Stats stats, bool w64,
                             void* payload, void* scratch, const kcu::HeaderWrite& hw,
                             bool accumulate) {
  if (stats == Stats::kExact) return exact_row_backward_partial_at(dev, a, payload);
  backward_kernel(dev, a, [&](const kcu::RowArgs& k, auto in) {
    kcu::row_partial_backward(k, in.dy, in.x, in.gamma, in.mean, in.rstd, w64, payload,
                              row_backward_scratch_at(a, stats) > 0 ? scratch : nullptr, hw,
                              accumulate);
  });
}

void row_backward_apply_at(DeviceCommunicator& dev, const RowBackward& a, const kcu::Header& hd,
                           void* scratch, int64_t parts) {
  if (hd.i64) return exact_row_backward_apply_at(dev, a, hd, scratch);
  backward_kernel(dev, a, [&](const kcu::RowArgs& k, auto in) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(in.x)>>;
    kcu::row_apply_backward(k, in.dy, in.x, in.gamma, in.mean, in.rstd, hd,
                            static_cast<T*>(a.dx.data), static_cast<T*>(a.dgamma.data),
                            a.centered ? static_cast<T*>(a.dbeta.data) : nullptr, scratch,
                            dev.error_word(), parts);
  });
}

void row_forward_partial_cuda(PackedCall& call, DeviceCommunicator& dev, const RowForwardCall& c) {
  row_forward_partial_at(dev, c.a, c.opt.stats, call.wire() == DType::F64, call.payload_data(),
                         header_for_partial(call));
}

void row_forward_apply_cuda(PackedCall& call, DeviceCommunicator& dev, const RowForwardCall& c) {
  row_forward_apply_at(dev, c.a, c.opt.eps, device_header(call, dev, hidden_want(c.opt)));
}

size_t row_backward_scratch_cuda(const RowBackwardCall& c) {
  return row_backward_scratch_at(c.a, c.opt.stats);
}

void row_backward_partial_cuda(PackedCall& call, DeviceCommunicator& dev,
                               const RowBackwardCall& c) {
  row_backward_partial_at(dev, c.a, c.opt.stats, call.wire() == DType::F64, call.payload_data(),
                          call.scratch(), header_for_partial(call));
}

void row_backward_apply_cuda(PackedCall& call, DeviceCommunicator& dev, const RowBackwardCall& c) {
  row_backward_apply_at(dev, c.a, device_header(call, dev, hidden_want(c.opt)), call.scratch());
}

}  // namespace tpnorm::detail
