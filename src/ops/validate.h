// validate.h — local argument checks shared by the ops. Each check records the first failure
// on the PackedCall (which all ranks then agree on) instead of throwing, so that a bad argument
// on one rank still lets that rank join the call's collective. Once a check has failed, every
// later check is a no-op that returns false: an op's validation is a list of checks, one per
// line, in the order of its messages, and a check never looks at a view an earlier one refused.
#pragma once

#include <cmath>
#include <initializer_list>
#include <string>

#include "ops/packed_call.h"
#include "tpnorm/norm.h"
#include "tpnorm/tensor.h"

namespace tpnorm::detail {

/// Product of dims [0, n) into *out; false on a negative dim or int64 overflow (which would be
/// undefined behaviour in Shape::numel). Element counts are int64 throughout: > 2^31 is fine.
inline bool checked_product(const Shape& s, int n, int64_t* out) {
  int64_t p = 1;
  for (int i = 0; i < n; ++i)
    if (s.dims[i] < 0 || __builtin_mul_overflow(p, s.dims[i], &p)) return false;
  *out = p;
  return true;
}

/// True when every dim is >= 0 and the product of the non-zero dims fits int64. Then the
/// product of ANY subset of dims (rows, spatial, inner) fits too, even when an empty dim makes
/// the element count 0 ([0, 2^40, 2^40] has 0 elements but 2^80 "rows per sample"). The ops
/// compute their geometry only from shapes that pass this, and Validator::usable rejects the
/// rest, so no shape reaches a product that overflows.
inline bool shape_fits(const Shape& s) {
  int64_t p = 1;
  for (int i = 0; i < s.ndim; ++i)
    if (s.dims[i] < 0 || (s.dims[i] > 0 && __builtin_mul_overflow(p, s.dims[i], &p))) return false;
  return true;
}

/// The dtype of a norm's parameters and their gradients: the first present of `views`, else
/// x's. Valid: x's storage dtype, or float32 with fp16/bf16 x (Validator::params).
inline DType param_dtype(const TensorView& x, std::initializer_list<const TensorView*> views) {
  for (const TensorView* v : views)
    if (v->present()) return v->dtype;
  return x.dtype;
}

class Validator {
 public:
  /// stats: the call's statistics mode (which storage dtypes it can take, see storage).
  Validator(PackedCall& call, Device device, Stats stats = Stats::kRobust)
      : call_(call), device_(device), stats_(stats) {}

  /// A present view on the call's device whose data is non-null unless it is empty.
  /// True while no check of this call has failed.
  bool ok() const { return !call_.failed(); }

  bool usable(const char* name, const TensorView& v) {
    if (!ok()) return false;
    if (!v.present()) return fail(name, "is required but absent");
    if (v.device != device_) return fail(name, "lives on a device other than the communicator's");
    int64_t n = 0;
    if (!shape_fits(v.shape) || !checked_product(v.shape, v.shape.ndim, &n))
      return fail(name, "has a negative dimension or dimensions whose product exceeds 2^63: " +
                            v.shape.str());
    if (n > 0 && !v.data) return fail(name, "is null but has " + std::to_string(n) + " elements");
    return true;
  }
  bool dtype_in(const char* name, const TensorView& v, std::initializer_list<DType> allowed) {
    if (!ok()) return false;
    for (DType t : allowed)
      if (v.dtype == t) return true;
    return fail(name, std::string("has unsupported dtype ") + dtype_name(v.dtype));
  }
  bool same_dtype(const char* name, const TensorView& v, DType t) {
    if (!ok()) return false;
    return v.dtype == t || fail(name, std::string("has dtype ") + dtype_name(v.dtype) +
                                          ", expected " + dtype_name(t));
  }
  bool same_shape(const char* name, const TensorView& v, const Shape& s) {
    if (!ok()) return false;
    return v.shape == s || fail(name, "has shape " + v.shape.str() + ", expected " + s.str());
  }
  bool numel_is(const char* name, const TensorView& v, int64_t n) {
    if (!ok()) return false;
    return v.numel() == n || fail(name, "has " + std::to_string(v.numel()) + " elements (shape " +
                                            v.shape.str() + "), expected " + std::to_string(n));
  }
  /// An optional view: absent, or usable with `n` elements of dtype `t`.
  bool optional(const char* name, const TensorView& v, int64_t n, DType t) {
    if (!ok()) return false;
    if (!v.present()) return true;
    return usable(name, v) && numel_is(name, v, n) && same_dtype(name, v, t);
  }
  /// An optional view of saved statistics: absent, or `n` elements of float32 / float64 `t`.
  bool optional_stats(const char* name, const TensorView& v, int64_t n, DType t) {
    if (!optional(name, v, n, t)) return false;
    return !v.present() || dtype_in(name, v, {DType::F32, DType::F64});
  }
  /// A required view of saved statistics: `n` elements of float32 / float64.
  bool stats(const char* name, const TensorView& v, int64_t n) {
    return usable(name, v) && numel_is(name, v, n) && dtype_in(name, v, {DType::F32, DType::F64});
  }
  /// A required view of `n` saved statistics in the dtype of `other` (mean next to rstd).
  bool stats_like(const char* name, const TensorView& v, int64_t n, const TensorView& other) {
    return usable(name, v) && numel_is(name, v, n) && same_dtype(name, v, other.dtype);
  }
  /// A required view of x's shape and dtype (an output or a gradient of x).
  bool like(const char* name, const TensorView& v, const TensorView& x) {
    return usable(name, v) && same_shape(name, v, x.shape) && same_dtype(name, v, x.dtype);
  }
  /// A storage dtype: the dtypes of x, y, gamma... (saved statistics are float32/float64).
  /// fp64 runs on the CPU kernels (kernels/cpu/float64.cpp) in Stats::kRobust only: kNaive's
  /// wire is float32, and kExact's integer grid covers float32's range, not float64's (2^-1074
  /// to 2^1024 would take some 2100 bits a sum instead of a few limbs).
  bool storage(const char* name, const TensorView& v) {
    if (!dtype_in(name, v, {DType::F32, DType::F16, DType::BF16, DType::F64})) return false;
    if (v.dtype != DType::F64) return true;
    if (device_.kind != DeviceKind::CPU)
      return fail(name, "is fp64: float64 storage runs on the CPU kernels only so far (a host "
                        "communicator)");
    if (stats_ != Stats::kRobust)
      return fail(name, std::string("is fp64, which needs Stats::kRobust (float64 statistics); ") +
                            (stats_ == Stats::kNaive
                                 ? "Stats::kNaive sends float32 sums"
                                 : "Stats::kExact's integer grid covers float32's range only"));
    return true;
  }
  /// The dtype of a norm's parameters (gamma / beta and their gradients; see param_dtype): x's,
  /// or float32 next to fp16/bf16 x on the CPU kernels (mixed precision). `name`: the first
  /// present parameter, for the message.
  bool params(const char* name, DType param, const TensorView& x) {
    if (!ok() || param == x.dtype) return ok();
    if (x.dtype == DType::F64)  // no float32 rounding on a float64 path
      return fail(name, std::string("has dtype ") + dtype_name(param) + ", expected x's (fp64)");
    if (param != DType::F32)
      return fail(name, std::string("has dtype ") + dtype_name(param) + ", expected x's (" +
                            dtype_name(x.dtype) + ") or fp32");
    if (x.device.kind != DeviceKind::CPU)
      return fail(name, "is fp32 next to " + std::string(dtype_name(x.dtype)) +
                            " x: mixed precision runs on the CPU kernels only so far");
    return true;
  }
  bool eps(double e) {
    if (!ok()) return false;
    return (std::isfinite(e) && e > 0) ||
           fail("eps", "must be finite and > 0, got " + std::to_string(e));
  }
  /// Records `what` about argument `name` unless an earlier check failed; returns false.
  bool fail(const char* name, const std::string& what) {
    call_.fail(std::string("argument '") + name + "' " + what);
    return false;
  }

 private:
  PackedCall& call_;
  Device device_;
  Stats stats_;
};

}  // namespace tpnorm::detail
