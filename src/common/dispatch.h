// dispatch.h — the one dtype dispatch: turns a runtime DType into a storage type T.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "common/half.h"
#include "tpnorm/tensor.h"

namespace tpnorm::detail {

/// Calls fn(T{}) with T the storage type of `t` on the CPU kernels (float, f16, bf16, double).
/// Callers validate first: x's dtype is a storage dtype (Validator::storage).
template <class Fn>
decltype(auto) dispatch_storage(DType t, Fn&& fn) {
  switch (t) {
    case DType::F16:
      return std::forward<Fn>(fn)(f16{});
    case DType::BF16:
      return std::forward<Fn>(fn)(bf16{});
    case DType::F64:
      return std::forward<Fn>(fn)(double{});
    default:
      return std::forward<Fn>(fn)(float{});
  }
}

/// dispatch_storage for the CUDA kernels, which have no float64 storage (run_op refuses it on a
/// device communicator before any hook runs).
template <class Fn>
decltype(auto) dispatch_device_storage(DType t, Fn&& fn) {
  switch (t) {
    case DType::F16:
      return std::forward<Fn>(fn)(f16{});
    case DType::BF16:
      return std::forward<Fn>(fn)(bf16{});
    default:
      return std::forward<Fn>(fn)(float{});
  }
}

/// Whether storage type T (or a reference to it) has Stats::kExact kernels: every one but
/// double (float64 storage refuses Stats::kExact in its validation, Validator::storage).
template <class T>
inline constexpr bool has_exact_kernels = !std::is_same_v<std::decay_t<T>, double>;

/// Calls fn(S{}) with S float or double for the dtype of saved statistics / wire buffers.
template <class Fn>
decltype(auto) dispatch_acc(DType t, Fn&& fn) {
  if (t == DType::F64) return std::forward<Fn>(fn)(double{});
  return std::forward<Fn>(fn)(float{});
}

/// fn(T{}, W{}, S{}): the storage type, the wire (accumulation) type and the saved-statistics
/// type of one kernel call, dispatched together.
template <class Fn>
void dispatch_kernel_types(DType storage, DType wire, DType stats, Fn&& fn) {
  dispatch_storage(storage, [&](auto t) {
    dispatch_acc(wire, [&](auto w) { dispatch_acc(stats, [&](auto s) { fn(t, w, s); }); });
  });
}

/// The forward partial of the CPU norms in every statistics mode, x cast once: exact(x, limbs)
/// for Stats::kExact (wire I64, int64 limbs), else sums(x, payload) with the payload in the
/// wire's accumulator type W. Both are called with typed pointers, so the kernels' template
/// arguments are deduced.
template <class Exact, class Sums>
void dispatch_forward_partial(const TensorView& x, DType wire, void* payload, Exact&& exact,
                              Sums&& sums) {
  dispatch_storage(x.dtype, [&](auto t) {
    using T = decltype(t);
    const T* xt = static_cast<const T*>(x.data);
    // float64 storage has no exact mode (its validation refuses Stats::kExact).
    if constexpr (has_exact_kernels<T>)
      if (wire == DType::I64) return exact(xt, static_cast<int64_t*>(payload));
    dispatch_acc(wire, [&](auto w) { sums(xt, static_cast<decltype(w)*>(payload)); });
  });
}

/// fn(P{}) with P the parameter type (gamma / beta and their gradients) of a kernel of storage
/// type T: T, or float for float32 parameters next to fp16/bf16 x (mixed precision); float64
/// x has float64 parameters only (Validator::params).
template <class T, class Fn>
void dispatch_params(DType param, Fn&& fn) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    fn(T{});
  } else {
    if (param == DType::F32)
      fn(float{});
    else
      fn(T{});
  }
}

}  // namespace tpnorm::detail
