// row_stages.cpp — see row_stages.h. The dtype dispatch of the CPU row kernels lives here once.
#include "ops/row_stages.h"

#include <vector>

#include "common/dispatch.h"
#include "kernels/cpu/exact_rows.h"
#include "kernels/cpu/row_norm.h"
#include "tpnorm/error.h"

namespace tpnorm::detail {
namespace {

namespace kc = kernels::cpu;

kc::RowNormArgs kernel_args(const RowGeometry& g, bool centered, RowRun run) {
  kc::RowNormArgs k{g.rows, g.h, centered, run.threads, run.fused};
  k.row0 = run.row0;
  k.call_rows = run.call_rows;
  k.param_acc = run.param_acc;
  k.param_last = run.param_last;
  k.params_in_partial = run.params_in_partial;
  return k;
}

// RowRun's prefetch rows as kernel pointers: view v holds rows from run.row0 on (a chunk's
// slice of the call's tensor), the prefetched rows lie further in the same tensor.
void prefetch_args(kc::RowNormArgs& k, const TensorView& x, const TensorView& dy, RowRun run) {
  if (run.pf_end <= run.pf_begin || !x.data) return;
  const auto at = [&](const TensorView& v) -> const void* {
    if (!v.data) return nullptr;
    return static_cast<const char*>(v.data) +
           static_cast<size_t>((run.pf_begin - run.row0) * k.h) * dtype_size(v.dtype);
  };
  k.pf_x = at(x);
  k.pf_dy = at(dy);
  k.pf_rows = run.pf_end - run.pf_begin;
}

// Rows [r0, r1) of a view of rows x h elements (leading dims flattened); absent stays absent.
TensorView row_slice(const TensorView& v, int64_t r0, int64_t r1, int64_t h) {
  if (!v.present() || !v.data) return v;
  TensorView s = v;
  s.data = static_cast<char*>(v.data) + static_cast<size_t>(r0 * h) * dtype_size(v.dtype);
  s.shape = h == 1 && v.shape.ndim == 1 ? Shape{r1 - r0} : Shape{r1 - r0, h};
  return s;
}

// Stats::kExact (wire int64): the summed limbs become each row's final statistics, which the
// apply kernels then take as they are (RowNormArgs::final_stats) in place of the W moments;
// stats and wire then point at them (F64). The returned vector holds them: keep it alive for
// the apply. With run.fused (one rank) the apply kernel computes them from each row itself.
// Other modes: nothing changes, the vector is empty.
std::vector<double> exact_final_stats(kc::RowNormArgs& k, bool forward, void*& stats, DType& wire,
                                      double n) {
  std::vector<double> out;
  if (wire != DType::I64) return out;
  out.resize(static_cast<size_t>(k.rows * (k.centered ? 2 : 1)));
  if (!k.fused) kc::exact_row_finish(k, forward, static_cast<const int64_t*>(stats), n, out.data());
  k.final_stats = true;
  stats = out.data();
  wire = DType::F64;
  return out;
}

// A view's data as U*; nullptr where the view is absent or not the call's (`used` false).
template <class U>
U* typed(const TensorView& v, bool used = true) {
  return used ? static_cast<U*>(v.data) : nullptr;
}

// The views of one row call (either direction) cast once to the kernels' types: T for x, dy,
// y, dx; P for the parameters; S for the saved statistics. The other direction's pointers stay
// nullptr, as do mean, beta and dbeta for RMSNorm (not centered): that is how the kernels tell
// LayerNorm from RMSNorm.
template <class T, class P, class S>
struct RowPtrs {
  explicit RowPtrs(const RowForward& a) : RowPtrs(a.x, a.gamma, a.mean, a.rstd, a.centered) {
    beta = typed<const P>(a.beta, a.centered);
    y = typed<T>(a.y);
  }
  explicit RowPtrs(const RowBackward& a) : RowPtrs(a.x, a.gamma, a.mean, a.rstd, a.centered) {
    dy = typed<const T>(a.dy);
    dx = typed<T>(a.dx);
    dgamma = typed<P>(a.dgamma);
    dbeta = typed<P>(a.dbeta, a.centered);
  }

  const T* x;
  const T* dy = nullptr;
  const P* gamma;
  const P* beta = nullptr;
  S* mean;  // written by the forward, read by the backward
  S* rstd;
  T* y = nullptr;
  T* dx = nullptr;
  P* dgamma = nullptr;
  P* dbeta = nullptr;

 private:
  RowPtrs(const TensorView& x_, const TensorView& gamma_, const TensorView& mean_,
          const TensorView& rstd_, bool centered)
      : x(typed<const T>(x_)),
        gamma(typed<const P>(gamma_)),
        mean(typed<S>(mean_, centered)),
        rstd(typed<S>(rstd_)) {}
};

// fn(RowPtrs<T, P, S>) for the call's storage type T (x's dtype), parameter type P and
// saved-statistics type S (`stats`): the one dispatch of the row kernels; the wire type is left
// to fn, since the exact mode's partials take int64 limbs instead.
template <class Args, class Fn>
void with_row_ptrs(const Args& a, DType stats, Fn&& fn) {
  dispatch_storage(a.x.dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_params<T>(a.param, [&](auto p) {
      dispatch_acc(stats, [&](auto s) { fn(RowPtrs<T, decltype(p), decltype(s)>(a)); });
    });
  });
}

}  // namespace

RowForward rows_of(const RowForward& a, int64_t r0, int64_t r1) {
  RowForward c = a;
  const int64_t h = a.g.h;
  c.x = row_slice(a.x, r0, r1, h);
  c.y = row_slice(a.y, r0, r1, h);
  c.mean = row_slice(a.mean, r0, r1, 1);
  c.rstd = row_slice(a.rstd, r0, r1, 1);
  c.g.rows = r1 - r0;
  return c;
}

RowBackward rows_of(const RowBackward& a, int64_t r0, int64_t r1) {
  RowBackward c = a;
  const int64_t h = a.g.h;
  c.dy = row_slice(a.dy, r0, r1, h);
  c.x = row_slice(a.x, r0, r1, h);
  c.dx = row_slice(a.dx, r0, r1, h);
  c.mean = row_slice(a.mean, r0, r1, 1);
  c.rstd = row_slice(a.rstd, r0, r1, 1);
  c.g.rows = r1 - r0;
  return c;
}

bool row_backward_params_in_partial(const RowBackward& a, DType wire, RowRun run) {
  return !run.fused && wire != DType::I64 && (a.dgamma.data || (a.centered && a.dbeta.data));
}

size_t row_backward_acc_size(const RowBackward& a, DType wire, RowRun run) {
  kc::RowNormArgs k = kernel_args(a.g, a.centered, run);
  k.final_stats = wire == DType::I64;  // the exact mode's fixed row blocks
  return kc::row_param_acc_size(k);
}

void check_row_count(const NormOptions& opt, double n, const char* op) {
  check_naive_count(opt.stats, n, op, "row");
  if (opt.hidden_size > 0 && n != static_cast<double>(opt.hidden_size))
    throw Error(ErrorCode::kInvalidArgument,
                std::string("tpnorm: ") + op +
                    ": the ranks' slices of the hidden dimension add up to " +
                    std::to_string(static_cast<int64_t>(n)) +
                    " elements per row, but the hidden size is " +
                    std::to_string(opt.hidden_size));
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
  v.params((a.gamma.present() || !a.centered ? gamma : beta).c_str(), a.param, a.x);
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
  v.params((a.gamma.present() ? gamma : a.dgamma.present() ? dgamma : dbeta).c_str(), a.param, a.x);
  v.optional(gamma.c_str(), a.gamma, a.g.h, a.param);
  v.stats(rstd.c_str(), a.rstd, a.g.rows);
  if (a.centered) v.stats_like(mean.c_str(), a.mean, a.g.rows, a.rstd);
  v.optional(dgamma.c_str(), a.dgamma, a.g.h, a.param);
  if (a.centered) v.optional(dbeta.c_str(), a.dbeta, a.g.h, a.param);
}

void row_forward_partial(const RowForward& a, DType wire, void* stats, RowRun run) {
  const kc::RowNormArgs k = kernel_args(a.g, a.centered, run);
  dispatch_forward_partial(
      a.x, wire, stats,
      [&](const auto* x, int64_t* limbs) { kc::row_exact_partial_forward(k, x, limbs); },
      [&](const auto* x, auto* sums) { kc::row_partial_forward(k, x, sums); });
}

void row_forward_apply(const RowForward& a, DType wire, void* stats, double n, double eps,
                       RowRun run) {
  kc::RowNormArgs k = kernel_args(a.g, a.centered, run);
  prefetch_args(k, a.x, TensorView{}, run);
  const std::vector<double> exact = exact_final_stats(k, true, stats, wire, n);
  with_row_ptrs(a, saved_dtype(a.mean, a.rstd), [&](const auto& p) {
    dispatch_acc(wire, [&](auto w) {
      kc::row_apply_forward(k, p.x, p.gamma, p.beta, static_cast<decltype(w)*>(stats), n, eps, p.y,
                            p.mean, p.rstd);
    });
  });
}

void row_backward_partial(const RowBackward& a, DType wire, void* stats, RowRun run) {
  const kc::RowNormArgs k = kernel_args(a.g, a.centered, run);
  with_row_ptrs(a, a.rstd.dtype, [&](const auto& p) {
    if constexpr (has_exact_kernels<decltype(*p.x)>)
      if (wire == DType::I64)
        return kc::row_exact_partial_backward(k, p.dy, p.x, p.gamma, p.mean, p.rstd,
                                              static_cast<int64_t*>(stats));
    dispatch_acc(wire, [&](auto w) {
      kc::row_partial_backward(k, p.dy, p.x, p.gamma, p.mean, p.rstd,
                               static_cast<decltype(w)*>(stats));
    });
  });
}

void row_backward_apply(const RowBackward& a, DType wire, void* stats, double n, RowRun run) {
  kc::RowNormArgs k = kernel_args(a.g, a.centered, run);
  prefetch_args(k, a.x, a.dy, run);
  const std::vector<double> exact = exact_final_stats(k, false, stats, wire, n);
  with_row_ptrs(a, a.rstd.dtype, [&](const auto& p) {
    dispatch_acc(wire, [&](auto w) {
      kc::row_apply_backward(k, p.dy, p.x, p.gamma, p.mean, p.rstd,
                             static_cast<decltype(w)*>(stats), n, p.dx, p.dgamma, p.dbeta);
    });
  });
}

}  // namespace tpnorm::detail
