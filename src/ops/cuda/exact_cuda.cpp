// exact_cuda.cpp — see exact_cuda.h. As row_norm_cuda.cpp: nothing here synchronises the host
// or allocates; the kernels check the call's summed (int64) header on device.
#include "ops/cuda/exact_cuda.h"

#include <cstdint>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/dispatch.h"
#include "kernels/cuda/exact_rows.h"

namespace tpnorm::detail {
namespace {

namespace kcu = kernels::cuda;

kcu::ExactRowArgs exact_args(DeviceCommunicator& dev, const RowGeometry& g, bool centered,
                             bool s64) {
  return {g.rows, g.h, centered, s64, dev.stream()};
}

// fn(T{}) with T the storage type of x, on the communicator's device.
template <class Fn>
void on_device(DeviceCommunicator& dev, DType dtype, Fn&& fn) {
  DeviceGuard guard(dev.device_index());
  dispatch_device_storage(dtype, [&](auto t) { fn(t); });
}

template <class T>
const T* in(const TensorView& v) {
  return static_cast<const T*>(v.data);
}
template <class T>
T* out(const TensorView& v) {
  return static_cast<T*>(v.data);
}

}  // namespace

void exact_row_forward_partial_at(DeviceCommunicator& dev, const RowForward& a, void* payload) {
  const auto k = exact_args(dev, a.g, a.centered, false);
  on_device(dev, a.x.dtype, [&](auto t) {
    using T = decltype(t);
    kcu::exact_row_partial_forward<T>(k, in<T>(a.x), static_cast<int64_t*>(payload));
  });
}

void exact_row_forward_apply_at(DeviceCommunicator& dev, const RowForward& a, double eps,
                                const kcu::Header& hd) {
  const auto k = exact_args(dev, a.g, a.centered, saved_dtype(a.mean, a.rstd) == DType::F64);
  on_device(dev, a.x.dtype, [&](auto t) {
    using T = decltype(t);
    kcu::exact_row_apply_forward<T>(
        k, in<T>(a.x), in<T>(a.gamma), a.centered ? in<T>(a.beta) : nullptr, hd, eps, out<T>(a.y),
        a.centered ? a.mean.data : nullptr, a.rstd.data, dev.error_word());
  });
}

size_t exact_row_backward_scratch_at(const RowBackward& a) {
  const bool params = a.dgamma.present() || (a.centered && a.dbeta.present());
  return kcu::exact_row_scratch_bytes(a.g.rows, a.g.h, params);
}

void exact_row_backward_partial_at(DeviceCommunicator& dev, const RowBackward& a, void* payload) {
  const auto k = exact_args(dev, a.g, a.centered, a.rstd.dtype == DType::F64);
  on_device(dev, a.x.dtype, [&](auto t) {
    using T = decltype(t);
    kcu::exact_row_partial_backward<T>(k, in<T>(a.dy), in<T>(a.x), in<T>(a.gamma),
                                       a.centered ? a.mean.data : nullptr, a.rstd.data,
                                       static_cast<int64_t*>(payload));
  });
}

void exact_row_backward_apply_at(DeviceCommunicator& dev, const RowBackward& a,
                                 const kcu::Header& hd, void* scratch) {
  const auto k = exact_args(dev, a.g, a.centered, a.rstd.dtype == DType::F64);
  on_device(dev, a.x.dtype, [&](auto t) {
    using T = decltype(t);
    kcu::exact_row_apply_backward<T>(
        k, in<T>(a.dy), in<T>(a.x), in<T>(a.gamma), a.centered ? a.mean.data : nullptr, a.rstd.data,
        hd, out<T>(a.dx), out<T>(a.dgamma), a.centered ? out<T>(a.dbeta) : nullptr, scratch,
        dev.error_word());
  });
}

}  // namespace tpnorm::detail
