// row_stages.cpp — see row_stages.h. The dtype dispatch of the CPU row kernels lives here once.
#include "ops/row_stages.h"

#include <type_traits>
#include <vector>

#include "common/dispatch.h"
#include "kernels/cpu/exact_rows.h"
#include "kernels/cpu/row_norm.h"

namespace tpnorm::detail {
namespace {

namespace kc = kernels::cpu;

kc::RowNormArgs kernel_args(const RowGeometry& g, bool centered, RowRun run) {
  return {g.rows, g.h, centered, run.threads, run.fused};
}

// Stats::kExact (wire int64): the summed limbs become each row's final statistics, which the
// apply kernels then take as they are (RowNormArgs::final_stats) in place of the W moments.
// With run.fused (one rank) the apply kernel computes them from each row itself instead.
std::vector<double> exact_final_stats(kc::RowNormArgs& k, bool forward, const void* limbs,
                                      double n) {
  std::vector<double> out(static_cast<size_t>(k.rows * (k.centered ? 2 : 1)));
  if (!k.fused) kc::exact_row_finish(k, forward, static_cast<const int64_t*>(limbs), n, out.data());
  k.final_stats = true;
  return out;
}

// fn(P{}) with P the parameter type: T, or float for float32 parameters of fp16/bf16 x.
template <class T, class Fn>
void dispatch_params(DType param, Fn&& fn) {
  if constexpr (std::is_same_v<T, float>) {
    fn(float{});
  } else {
    if (param == DType::F32)
      fn(float{});
    else
      fn(T{});
  }
}

// The parameters' dtype is x's, or float32 next to fp16/bf16 x on the CPU kernels.
void validate_params(Validator& v, const std::string& name, DType param, const TensorView& x) {
  if (param == x.dtype) return;
  if (param != DType::F32) {
    v.fail(name.c_str(), std::string("has dtype ") + dtype_name(param) + ", expected x's (" +
                             dtype_name(x.dtype) + ") or fp32");
  } else if (x.device.kind != DeviceKind::CPU) {
    v.fail(name.c_str(), "is fp32 next to " + std::string(dtype_name(x.dtype)) +
                             " x: mixed precision runs on the CPU kernels only so far");
  }
}

}  // namespace

DType param_dtype(const TensorView& x, std::initializer_list<const TensorView*> views) {
  for (const TensorView* v : views)
    if (v->present()) return v->dtype;
  return x.dtype;
}

int64_t row_stat_width(bool centered, Stats stats, bool forward) {
  if (stats == Stats::kExact) return kc::exact_row_limbs(centered, forward);
  return centered ? 2 : 1;
}

RowGeometry row_geometry(const TensorView& x) {
  RowGeometry g;
  if (x.shape.ndim == 0 || !shape_fits(x.shape)) return g;  // {0, 0}: the validator rejects x
  g.h = x.shape[x.shape.ndim - 1];
  g.rows = 1;
  for (int i = 0; i + 1 < x.shape.ndim; ++i) g.rows *= x.shape[i];
  return g;
}

void validate_row_forward(Validator& v, const std::string& p, const RowForward& a) {
  const std::string x = p + "x", y = p + "y", gamma = p + "gamma", beta = p + "beta",
                    mean = p + "mean", rstd = p + "rstd";
  v.usable(x.c_str(), a.x);
  v.storage(x.c_str(), a.x);
  v.like(y.c_str(), a.y, a.x);
  validate_params(v, a.gamma.present() || !a.centered ? gamma : beta, a.param, a.x);
  v.optional(gamma.c_str(), a.gamma, a.g.h, a.param);
  if (a.centered) v.optional(beta.c_str(), a.beta, a.g.h, a.param);
  v.optional_stats(rstd.c_str(), a.rstd, a.g.rows, a.rstd.dtype);
  if (a.centered) v.optional_stats(mean.c_str(), a.mean, a.g.rows, saved_dtype(a.mean, a.rstd));
}

void validate_row_backward(Validator& v, const std::string& p, const RowBackward& a) {
  const std::string x = p + "x", dy = p + "dy", dx = p + "dx", gamma = p + "gamma",
                    mean = p + "mean", rstd = p + "rstd", dgamma = p + "dgamma",
                    dbeta = p + "dbeta";
  v.usable(x.c_str(), a.x);
  v.storage(x.c_str(), a.x);
  v.like(dy.c_str(), a.dy, a.x);
  v.like(dx.c_str(), a.dx, a.x);
  validate_params(v, a.gamma.present() ? gamma : a.dgamma.present() ? dgamma : dbeta, a.param,
                  a.x);
  v.optional(gamma.c_str(), a.gamma, a.g.h, a.param);
  v.stats(rstd.c_str(), a.rstd, a.g.rows);
  if (a.centered) v.stats_like(mean.c_str(), a.mean, a.g.rows, a.rstd);
  v.optional(dgamma.c_str(), a.dgamma, a.g.h, a.param);
  if (a.centered) v.optional(dbeta.c_str(), a.dbeta, a.g.h, a.param);
}

void row_forward_partial(const RowForward& a, DType wire, void* stats, RowRun run) {
  const kc::RowNormArgs k = kernel_args(a.g, a.centered, run);
  if (wire == DType::I64)
    return dispatch_storage(a.x.dtype, [&](auto t) {
      using T = decltype(t);
      kc::row_exact_partial_forward<T>(k, static_cast<const T*>(a.x.data),
                                       static_cast<int64_t*>(stats));
    });
  dispatch_storage(a.x.dtype, [&](auto t) {
    dispatch_acc(wire, [&](auto w) {
      using T = decltype(t);
      using W = decltype(w);
      kc::row_partial_forward<T, W>(k, static_cast<const T*>(a.x.data), static_cast<W*>(stats));
    });
  });
}

void row_forward_apply(const RowForward& a, DType wire, void* stats, double n, double eps,
                       RowRun run) {
  kc::RowNormArgs k = kernel_args(a.g, a.centered, run);
  std::vector<double> exact;
  if (wire == DType::I64) {
    exact = exact_final_stats(k, true, stats, n);
    stats = exact.data();
    wire = DType::F64;
  }
  dispatch_kernel_types(a.x.dtype, wire, saved_dtype(a.mean, a.rstd), [&](auto t, auto w, auto s) {
    using T = decltype(t);
    using W = decltype(w);
    using S = decltype(s);
    dispatch_params<T>(a.param, [&](auto p) {
      using P = decltype(p);
      kc::row_apply_forward<T, P, W, S>(
          k, static_cast<const T*>(a.x.data), static_cast<const P*>(a.gamma.data),
          a.centered ? static_cast<const P*>(a.beta.data) : nullptr, static_cast<W*>(stats), n,
          eps, static_cast<T*>(a.y.data), a.centered ? static_cast<S*>(a.mean.data) : nullptr,
          static_cast<S*>(a.rstd.data));
    });
  });
}

void row_backward_partial(const RowBackward& a, DType wire, void* stats, RowRun run) {
  const kc::RowNormArgs k = kernel_args(a.g, a.centered, run);
  if (wire == DType::I64)
    return dispatch_storage(a.x.dtype, [&](auto t) {
      dispatch_acc(a.rstd.dtype, [&](auto s) {
        using T = decltype(t);
        using S = decltype(s);
        dispatch_params<T>(a.param, [&](auto p) {
          using P = decltype(p);
          kc::row_exact_partial_backward<T, P, S>(
              k, static_cast<const T*>(a.dy.data), static_cast<const T*>(a.x.data),
              static_cast<const P*>(a.gamma.data),
              a.centered ? static_cast<const S*>(a.mean.data) : nullptr,
              static_cast<const S*>(a.rstd.data), static_cast<int64_t*>(stats));
        });
      });
    });
  dispatch_kernel_types(a.x.dtype, wire, a.rstd.dtype, [&](auto t, auto w, auto s) {
    using T = decltype(t);
    using W = decltype(w);
    using S = decltype(s);
    dispatch_params<T>(a.param, [&](auto p) {
      using P = decltype(p);
      kc::row_partial_backward<T, P, W, S>(
          k, static_cast<const T*>(a.dy.data), static_cast<const T*>(a.x.data),
          static_cast<const P*>(a.gamma.data),
          a.centered ? static_cast<const S*>(a.mean.data) : nullptr,
          static_cast<const S*>(a.rstd.data), static_cast<W*>(stats));
    });
  });
}

void row_backward_apply(const RowBackward& a, DType wire, void* stats, double n, RowRun run) {
  kc::RowNormArgs k = kernel_args(a.g, a.centered, run);
  std::vector<double> exact;
  if (wire == DType::I64) {
    exact = exact_final_stats(k, false, stats, n);
    stats = exact.data();
    wire = DType::F64;
  }
  dispatch_kernel_types(a.x.dtype, wire, a.rstd.dtype, [&](auto t, auto w, auto s) {
    using T = decltype(t);
    using W = decltype(w);
    using S = decltype(s);
    dispatch_params<T>(a.param, [&](auto p) {
      using P = decltype(p);
      kc::row_apply_backward<T, P, W, S>(
          k, static_cast<const T*>(a.dy.data), static_cast<const T*>(a.x.data),
          static_cast<const P*>(a.gamma.data),
          a.centered ? static_cast<const S*>(a.mean.data) : nullptr,
          static_cast<const S*>(a.rstd.data), static_cast<W*>(stats), n,
          static_cast<T*>(a.dx.data), static_cast<P*>(a.dgamma.data),
          a.centered ? static_cast<P*>(a.dbeta.data) : nullptr);
    });
  });
}

}  // namespace tpnorm::detail
