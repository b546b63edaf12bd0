// fused.cpp — residual add + row norm: validate -> fused partial (writes h) -> ONE reduce ->
// the row norm's apply on h; backward: the row norm's stages on (dy, h) + residual epilogue.
#include "tpnorm/fused.h"

#include <cmath>
#include <string>

#include "common/dispatch.h"
#include "kernels/cpu/residual.h"
#include "ops/packed_call.h"
#include "ops/row_stages.h"

namespace tpnorm {
namespace {

namespace kc = kernels::cpu;
using detail::row_geometry;

void agree_common(detail::PackedCall& call, const TensorView& x, bool centered, double alpha,
                  const TensorView& gamma, const NormOptions& opt) {
  call.agree("rows", static_cast<double>(row_geometry(x).rows));
  call.agree("dtype", static_cast<double>(x.dtype));
  call.agree("centered", centered ? 1 : 0);
  call.agree("stats", static_cast<double>(opt.stats));
  call.agree("alpha", alpha);
  call.agree("gamma", gamma.present() ? 1 : 0);
}

bool alpha_ok(detail::Validator& v, double alpha) {
  return std::isfinite(alpha) || v.fail("alpha", "must be finite");
}

void forward(const char* op, bool centered, Communicator& comm, const TensorView& x,
             const TensorView& f, double alpha, const TensorView& gamma, const TensorView& beta,
             const TensorView& h, const TensorView& y, const TensorView& mean,
             const TensorView& rstd, const NormOptions& opt) {
  const detail::RowGeometry g = row_geometry(x);
  detail::PackedCall call(comm, op, detail::wire_of(opt.stats), opt.check_agreement);
  detail::Validator v(call, comm.device());
  // The norm's stages see h as their input: validate it as such, and x/f against it.
  const detail::RowForwardArgs norm{centered, h, gamma, beta, y, mean, rstd};
  detail::host_only(v, comm.device()) && v.eps(opt.eps) && alpha_ok(v, alpha) && v.usable("x", x) &&
      v.dtype_in("x", x, {DType::F32, DType::F16, DType::BF16}) && v.usable("f", f) &&
      v.same_shape("f", f, x.shape) && v.same_dtype("f", f, x.dtype) && v.usable("h", h) &&
      v.same_shape("h", h, x.shape) && v.same_dtype("h", h, x.dtype) &&
      detail::validate_row_forward(v, "", norm);
  agree_common(call, x, centered, alpha, gamma, opt);
  call.agree("eps", opt.eps);
  call.agree("beta", centered && beta.present() ? 1 : 0);

  call.prepare(static_cast<size_t>(g.rows * detail::row_stat_width(centered)),
               static_cast<double>(g.h));
  if (!call.failed()) {
    const kc::RowNormArgs a{g.rows, g.h, centered, opt.num_threads};
    detail::dispatch_storage(x.dtype, [&](auto t) {
      detail::dispatch_acc(call.wire(), [&](auto w) {
        using T = decltype(t);
        using W = decltype(w);
        kc::residual_partial_forward<T, W>(a, static_cast<const T*>(x.data),
                                           static_cast<const T*>(f.data), static_cast<float>(alpha),
                                           static_cast<T*>(h.data), call.payload<W>());
      });
    });
  }
  call.reduce();
  detail::check_naive_count(opt.stats, call.global_count());
  detail::row_forward_apply(norm, call.wire(), detail::payload_of(call), call.global_count(),
                            opt.eps, opt.num_threads);
}

void backward(const char* op, bool centered, Communicator& comm, const TensorView& dy,
              const TensorView& dh_extra, const TensorView& h, const TensorView& gamma,
              const TensorView& mean, const TensorView& rstd, double alpha, const TensorView& dx,
              const TensorView& df, const TensorView& dgamma, const TensorView& dbeta,
              const NormOptions& opt) {
  const detail::RowGeometry g = row_geometry(h);
  detail::PackedCall call(comm, op, detail::wire_of(opt.stats), opt.check_agreement);
  detail::Validator v(call, comm.device());
  // The norm's input gradient goes to df first; the epilogue then finishes df and dx.
  const detail::RowBackwardArgs norm{centered, dy, h, gamma, mean, rstd, df, dgamma, dbeta};
  // h and df are checked under their own names first: the stage calls them x and dx.
  detail::host_only(v, comm.device()) && alpha_ok(v, alpha) && v.usable("h", h) &&
      v.dtype_in("h", h, {DType::F32, DType::F16, DType::BF16}) && v.usable("df", df) &&
      v.same_shape("df", df, h.shape) && v.same_dtype("df", df, h.dtype) &&
      detail::validate_row_backward(v, "", norm) && v.usable("dx", dx) &&
      v.same_shape("dx", dx, h.shape) && v.same_dtype("dx", dx, h.dtype) &&
      (!dh_extra.present() ||
       (v.usable("dh_extra", dh_extra) && v.same_shape("dh_extra", dh_extra, h.shape) &&
        v.same_dtype("dh_extra", dh_extra, h.dtype)));
  agree_common(call, h, centered, alpha, gamma, opt);
  call.agree("dh_extra", dh_extra.present() ? 1 : 0);

  call.prepare(static_cast<size_t>(g.rows * detail::row_stat_width(centered)),
               static_cast<double>(g.h));
  if (!call.failed())
    detail::row_backward_partial(norm, call.wire(), detail::payload_of(call), opt.num_threads);
  call.reduce();
  detail::check_naive_count(opt.stats, call.global_count());
  detail::row_backward_apply(norm, call.wire(), detail::payload_of(call), call.global_count(),
                             opt.num_threads);
  detail::dispatch_storage(h.dtype, [&](auto t) {
    using T = decltype(t);
    kc::residual_backward_epilogue<T>(g.rows * g.h, static_cast<const T*>(dh_extra.data),
                                      static_cast<float>(alpha), static_cast<T*>(df.data),
                                      static_cast<T*>(dx.data), opt.num_threads);
  });
}

}  // namespace

double deepnorm_alpha(int64_t num_layers, DeepNormStack stack) {
  if (num_layers < 1)
    throw Error(
        ErrorCode::kInvalidArgument,
        "tpnorm: deepnorm_alpha: num_layers must be >= 1, got " + std::to_string(num_layers));
  const double k = stack == DeepNormStack::kEncoder ? 2.0 : 8.0;
  return std::pow(k * static_cast<double>(num_layers), 0.25);
}

void fused_add_layer_norm_forward(Communicator& comm, const TensorView& x, const TensorView& f,
                                  double alpha, const TensorView& gamma, const TensorView& beta,
                                  const TensorView& h, const TensorView& y, const TensorView& mean,
                                  const TensorView& rstd, const NormOptions& opt) {
  forward("fused_add_layer_norm_forward", true, comm, x, f, alpha, gamma, beta, h, y, mean, rstd,
          opt);
}

void fused_add_layer_norm_backward(Communicator& comm, const TensorView& dy,
                                   const TensorView& dh_extra, const TensorView& h,
                                   const TensorView& gamma, const TensorView& mean,
                                   const TensorView& rstd, double alpha, const TensorView& dx,
                                   const TensorView& df, const TensorView& dgamma,
                                   const TensorView& dbeta, const NormOptions& opt) {
  backward("fused_add_layer_norm_backward", true, comm, dy, dh_extra, h, gamma, mean, rstd, alpha,
           dx, df, dgamma, dbeta, opt);
}

void fused_add_rms_norm_forward(Communicator& comm, const TensorView& x, const TensorView& f,
                                double alpha, const TensorView& gamma, const TensorView& h,
                                const TensorView& y, const TensorView& rstd,
                                const NormOptions& opt) {
  forward("fused_add_rms_norm_forward", false, comm, x, f, alpha, gamma, TensorView{}, h, y,
          TensorView{}, rstd, opt);
}

void fused_add_rms_norm_backward(Communicator& comm, const TensorView& dy,
                                 const TensorView& dh_extra, const TensorView& h,
                                 const TensorView& gamma, const TensorView& rstd, double alpha,
                                 const TensorView& dx, const TensorView& df,
                                 const TensorView& dgamma, const NormOptions& opt) {
  backward("fused_add_rms_norm_backward", false, comm, dy, dh_extra, h, gamma, TensorView{}, rstd,
           alpha, dx, df, dgamma, TensorView{}, opt);
}

}  // namespace tpnorm
