// dispatch.h — the one dtype dispatch: turns a runtime DType into a storage type T.
#pragma once

#include <utility>

#include "common/half.h"
#include "tpnorm/tensor.h"

namespace tpnorm::detail {

/// Calls fn(T{}) with T the storage type of `t` (float, f16, bf16). F64 storage is not a norm
/// dtype; callers validate before dispatching.
template <class Fn>
decltype(auto) dispatch_storage(DType t, Fn&& fn) {
  switch (t) {
    case DType::F16:
      return std::forward<Fn>(fn)(f16{});
    case DType::BF16:
      return std::forward<Fn>(fn)(bf16{});
    default:
      return std::forward<Fn>(fn)(float{});
  }
}

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

}  // namespace tpnorm::detail
