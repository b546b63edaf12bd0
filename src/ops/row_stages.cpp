// row_stages.cpp — see row_stages.h. The dtype dispatch lives here once for every caller.
#include "ops/row_stages.h"

#include "common/dispatch.h"
#include "kernels/cpu/row_norm.h"
#include "tpnorm/error.h"

namespace tpnorm::detail {
namespace {

namespace kc = kernels::cpu;

// The saved-statistics dtype: rstd's, else mean's, else float32 (nothing saved).
DType saved_dtype(const TensorView& mean, const TensorView& rstd) {
  return rstd.present() ? rstd.dtype : (mean.present() ? mean.dtype : DType::F32);
}

template <class Fn>
void dispatch3(DType storage, DType wire, DType saved, Fn&& fn) {
  dispatch_storage(storage, [&](auto t) {
    dispatch_acc(wire, [&](auto w) { dispatch_acc(saved, [&](auto s) { fn(t, w, s); }); });
  });
}

}  // namespace

RowGeometry row_geometry(const TensorView& x) {
  RowGeometry g;
  if (x.shape.ndim == 0 || !shape_fits(x.shape)) return g;  // {0, 0}: the validator rejects x
  g.h = x.shape[x.shape.ndim - 1];
  g.rows = 1;
  for (int i = 0; i + 1 < x.shape.ndim; ++i) g.rows *= x.shape[i];
  return g;
}

bool validate_row_forward(Validator& v, const std::string& p, const RowForwardArgs& a) {
  const RowGeometry g = row_geometry(a.x);
  auto n = [&](const char* s) { return p + s; };
  const TensorView& x = a.x;
  return v.usable(n("x").c_str(), x) &&
         v.dtype_in(n("x").c_str(), x, {DType::F32, DType::F16, DType::BF16}) &&
         v.usable(n("y").c_str(), a.y) && v.same_shape(n("y").c_str(), a.y, x.shape) &&
         v.same_dtype(n("y").c_str(), a.y, x.dtype) &&
         v.optional(n("gamma").c_str(), a.gamma, g.h, x.dtype) &&
         (!a.centered || v.optional(n("beta").c_str(), a.beta, g.h, x.dtype)) &&
         v.optional(n("rstd").c_str(), a.rstd, g.rows, a.rstd.dtype) &&
         (!a.rstd.present() || v.dtype_in(n("rstd").c_str(), a.rstd, {DType::F32, DType::F64})) &&
         (!a.centered ||
          v.optional(n("mean").c_str(), a.mean, g.rows, saved_dtype(a.mean, a.rstd))) &&
         (!a.centered || !a.mean.present() ||
          v.dtype_in(n("mean").c_str(), a.mean, {DType::F32, DType::F64}));
}

bool validate_row_backward(Validator& v, const std::string& p, const RowBackwardArgs& a) {
  const RowGeometry g = row_geometry(a.x);
  auto n = [&](const char* s) { return p + s; };
  const TensorView& x = a.x;
  return v.usable(n("x").c_str(), x) &&
         v.dtype_in(n("x").c_str(), x, {DType::F32, DType::F16, DType::BF16}) &&
         v.usable(n("dy").c_str(), a.dy) && v.same_shape(n("dy").c_str(), a.dy, x.shape) &&
         v.same_dtype(n("dy").c_str(), a.dy, x.dtype) && v.usable(n("dx").c_str(), a.dx) &&
         v.same_shape(n("dx").c_str(), a.dx, x.shape) &&
         v.same_dtype(n("dx").c_str(), a.dx, x.dtype) &&
         v.optional(n("gamma").c_str(), a.gamma, g.h, x.dtype) &&
         v.usable(n("rstd").c_str(), a.rstd) && v.numel_is(n("rstd").c_str(), a.rstd, g.rows) &&
         v.dtype_in(n("rstd").c_str(), a.rstd, {DType::F32, DType::F64}) &&
         (!a.centered ||
          (v.usable(n("mean").c_str(), a.mean) && v.numel_is(n("mean").c_str(), a.mean, g.rows) &&
           v.same_dtype(n("mean").c_str(), a.mean, a.rstd.dtype))) &&
         v.optional(n("dgamma").c_str(), a.dgamma, g.h, x.dtype) &&
         (!a.centered || v.optional(n("dbeta").c_str(), a.dbeta, g.h, x.dtype));
}

void row_forward_partial(const RowForwardArgs& a, DType wire, void* stats, int threads) {
  const RowGeometry g = row_geometry(a.x);
  const kc::RowNormArgs k{g.rows, g.h, a.centered, threads};
  dispatch_storage(a.x.dtype, [&](auto t) {
    dispatch_acc(wire, [&](auto w) {
      using T = decltype(t);
      using W = decltype(w);
      kc::row_partial_forward<T, W>(k, static_cast<const T*>(a.x.data), static_cast<W*>(stats));
    });
  });
}

void row_forward_apply(const RowForwardArgs& a, DType wire, void* stats, double n, double eps,
                       int threads) {
  const RowGeometry g = row_geometry(a.x);
  const kc::RowNormArgs k{g.rows, g.h, a.centered, threads};
  dispatch3(a.x.dtype, wire, saved_dtype(a.mean, a.rstd), [&](auto t, auto w, auto s) {
    using T = decltype(t);
    using W = decltype(w);
    using S = decltype(s);
    kc::row_apply_forward<T, W, S>(
        k, static_cast<const T*>(a.x.data), static_cast<const T*>(a.gamma.data),
        a.centered ? static_cast<const T*>(a.beta.data) : nullptr, static_cast<W*>(stats), n, eps,
        static_cast<T*>(a.y.data), a.centered ? static_cast<S*>(a.mean.data) : nullptr,
        static_cast<S*>(a.rstd.data));
  });
}

void row_backward_partial(const RowBackwardArgs& a, DType wire, void* stats, int threads) {
  const RowGeometry g = row_geometry(a.x);
  const kc::RowNormArgs k{g.rows, g.h, a.centered, threads};
  dispatch3(a.x.dtype, wire, a.rstd.dtype, [&](auto t, auto w, auto s) {
    using T = decltype(t);
    using W = decltype(w);
    using S = decltype(s);
    kc::row_partial_backward<T, W, S>(k, static_cast<const T*>(a.dy.data),
                                      static_cast<const T*>(a.x.data),
                                      static_cast<const T*>(a.gamma.data),
                                      a.centered ? static_cast<const S*>(a.mean.data) : nullptr,
                                      static_cast<const S*>(a.rstd.data), static_cast<W*>(stats));
  });
}

void row_backward_apply(const RowBackwardArgs& a, DType wire, void* stats, double n, int threads) {
  const RowGeometry g = row_geometry(a.x);
  const kc::RowNormArgs k{g.rows, g.h, a.centered, threads};
  dispatch3(a.x.dtype, wire, a.rstd.dtype, [&](auto t, auto w, auto s) {
    using T = decltype(t);
    using W = decltype(w);
    using S = decltype(s);
    kc::row_apply_backward<T, W, S>(
        k, static_cast<const T*>(a.dy.data), static_cast<const T*>(a.x.data),
        static_cast<const T*>(a.gamma.data),
        a.centered ? static_cast<const S*>(a.mean.data) : nullptr,
        static_cast<const S*>(a.rstd.data), static_cast<W*>(stats), n, static_cast<T*>(a.dx.data),
        static_cast<T*>(a.dgamma.data), a.centered ? static_cast<T*>(a.dbeta.data) : nullptr);
  });
}

bool host_only(Validator& v, const Device& device) {
  return device.kind == DeviceKind::CPU ||
         v.fail("comm", "is a device communicator; this op has CPU kernels only so far");
}

void* payload_of(PackedCall& call) {
  void* p = nullptr;
  dispatch_acc(call.wire(), [&](auto w) { p = call.payload<decltype(w)>(); });
  return p;
}

void check_naive_count(Stats s, double n) {
  if (s == Stats::kNaive && n >= kNaiveCountLimit)
    throw Error(ErrorCode::kInvalidArgument,
                "tpnorm: the naive statistics mode supports fewer than 2^24 elements per row; "
                "use Stats::kRobust");
}

}  // namespace tpnorm::detail
