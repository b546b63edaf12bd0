// row_norm.cpp — the LayerNorm / RMSNorm pipelines: validate -> partial -> ONE reduce -> apply.
//
// LayerNorm and RMSNorm differ only in `centered` (see tpnorm/norm.h for the formulas); both
// go through forward() and backward() below. Nothing is written to an output before the
// collective has confirmed that every rank's arguments are valid and agree.
#include <cmath>

#include "common/dispatch.h"
#include "kernels/cpu/row_norm.h"
#include "ops/packed_call.h"
#include "ops/row_stages.h"
#include "ops/validate.h"
#include "tpnorm/norm.h"
#ifdef TPNORM_WITH_CUDA
#include "ops/cuda/row_norm_cuda.h"
#endif

namespace tpnorm {
namespace {

namespace kc = kernels::cpu;

// {0, 0} for a shape the validator rejects (see detail::shape_fits).
using Geometry = detail::RowGeometry;
Geometry geometry(const TensorView& x) { return detail::row_geometry(x); }

DType wire_of(Stats s) { return s == Stats::kNaive ? DType::F32 : DType::F64; }

// At one rank the reduce is the identity, so the apply kernels may compute each row's
// statistics themselves while the row is in cache: one pass over memory instead of two, the
// same bits, and still the call's one collective (which checks the arguments) before any output
// is written.
bool fused_at(const Communicator& comm) { return comm.size() == 1; }

void agree_common(detail::PackedCall& call, const TensorView& x, const Geometry& g,
                  const NormOptions& opt, bool centered) {
  call.agree("rows", static_cast<double>(g.rows));
  call.agree("dtype", static_cast<double>(x.dtype));
  call.agree("centered", centered ? 1 : 0);
  call.agree("stats", static_cast<double>(opt.stats));
}

void check_naive_count(detail::PackedCall& call, const NormOptions& opt) {
  if (opt.stats == Stats::kNaive && call.global_count() >= detail::kNaiveCountLimit)
    throw Error(ErrorCode::kInvalidArgument,
                "tpnorm: the naive statistics mode supports fewer than 2^24 elements per row; "
                "use Stats::kRobust");
}

void forward(const char* op, bool centered, Communicator& comm, const TensorView& x,
             const TensorView& gamma, const TensorView& beta, const TensorView& y,
             const TensorView& mean, const TensorView& rstd, const NormOptions& opt) {
  const Geometry g = geometry(x);
  detail::PackedCall call(comm, op, wire_of(opt.stats), opt.check_agreement);
  detail::Validator v(call, comm.device());
  // The same local checks as the fused and batched ops (row_stages), eps first.
  v.eps(opt.eps) &&
      detail::validate_row_forward(v, "", {centered, x, gamma, beta, y, mean, rstd});
  agree_common(call, x, g, opt, centered);
  call.agree("eps", opt.eps);
  call.agree("gamma", gamma.present() ? 1 : 0);
  call.agree("beta", beta.present() ? 1 : 0);
#ifdef TPNORM_WITH_CUDA
  if (call.device_comm())
    return detail::row_forward_cuda(call, centered, g.rows, g.h, x, gamma, beta, y, mean, rstd,
                                    opt);
#endif

  const int per_row = centered ? 2 : 1;
  // Same payload length on every rank that agrees on rows, failed or not.
  call.prepare(static_cast<size_t>(g.rows > 0 ? g.rows * per_row : 0), static_cast<double>(g.h));
  const kc::RowNormArgs a{g.rows, g.h, centered, opt.num_threads, fused_at(comm)};
  if (!call.failed() && !a.fused) {
    detail::dispatch_storage(x.dtype, [&](auto t) {
      using T = decltype(t);
      detail::dispatch_acc(call.wire(), [&](auto w) {
        using W = decltype(w);
        kc::row_partial_forward<T, W>(a, static_cast<const T*>(x.data), call.payload<W>());
      });
    });
  }
  call.reduce();
  check_naive_count(call, opt);

  const DType sdt = rstd.present() ? rstd.dtype : (mean.present() ? mean.dtype : DType::F32);
  detail::dispatch_kernel_types(x.dtype, call.wire(), sdt, [&](auto t, auto w, auto s) {
    using T = decltype(t);
    using W = decltype(w);
    using S = decltype(s);
    kc::row_apply_forward<T, W, S>(
        a, static_cast<const T*>(x.data), static_cast<const T*>(gamma.data),
        static_cast<const T*>(beta.data), call.payload<W>(), call.global_count(), opt.eps,
        static_cast<T*>(y.data), centered ? static_cast<S*>(mean.data) : nullptr,
        static_cast<S*>(rstd.data));
  });
}

void backward(const char* op, bool centered, Communicator& comm, const TensorView& dy,
              const TensorView& x, const TensorView& gamma, const TensorView& mean,
              const TensorView& rstd, const TensorView& dx, const TensorView& dgamma,
              const TensorView& dbeta, const NormOptions& opt) {
  const Geometry g = geometry(x);
  detail::PackedCall call(comm, op, wire_of(opt.stats), opt.check_agreement);
  detail::Validator v(call, comm.device());
  detail::validate_row_backward(v, "", {centered, dy, x, gamma, mean, rstd, dx, dgamma, dbeta});
  agree_common(call, x, g, opt, centered);
  call.agree("gamma", gamma.present() ? 1 : 0);
#ifdef TPNORM_WITH_CUDA
  if (call.device_comm())
    return detail::row_backward_cuda(call, centered, g.rows, g.h, dy, x, gamma, mean, rstd, dx,
                                     dgamma, dbeta);
#endif

  const int per_row = centered ? 2 : 1;
  // Same payload length on every rank that agrees on rows, failed or not.
  call.prepare(static_cast<size_t>(g.rows > 0 ? g.rows * per_row : 0), static_cast<double>(g.h));
  const kc::RowNormArgs a{g.rows, g.h, centered, opt.num_threads, fused_at(comm)};
  auto run = [&](auto&& body) {
    detail::dispatch_kernel_types(x.dtype, call.wire(), rstd.dtype, body);
  };
  if (!call.failed() && !a.fused) {
    run([&](auto t, auto w, auto s) {
      using T = decltype(t);
      using W = decltype(w);
      using S = decltype(s);
      kc::row_partial_backward<T, W, S>(
          a, static_cast<const T*>(dy.data), static_cast<const T*>(x.data),
          static_cast<const T*>(gamma.data), centered ? static_cast<const S*>(mean.data) : nullptr,
          static_cast<const S*>(rstd.data), call.payload<W>());
    });
  }
  call.reduce();
  check_naive_count(call, opt);
  run([&](auto t, auto w, auto s) {
    using T = decltype(t);
    using W = decltype(w);
    using S = decltype(s);
    kc::row_apply_backward<T, W, S>(
        a, static_cast<const T*>(dy.data), static_cast<const T*>(x.data),
        static_cast<const T*>(gamma.data), centered ? static_cast<const S*>(mean.data) : nullptr,
        static_cast<const S*>(rstd.data), call.payload<W>(), call.global_count(),
        static_cast<T*>(dx.data), static_cast<T*>(dgamma.data),
        centered ? static_cast<T*>(dbeta.data) : nullptr);
  });
}

}  // namespace

void layer_norm_forward(Communicator& comm, const TensorView& x, const TensorView& gamma,
                        const TensorView& beta, const TensorView& y, const TensorView& mean,
                        const TensorView& rstd, const NormOptions& opt) {
  forward("layer_norm_forward", true, comm, x, gamma, beta, y, mean, rstd, opt);
}

void layer_norm_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                         const TensorView& gamma, const TensorView& mean, const TensorView& rstd,
                         const TensorView& dx, const TensorView& dgamma, const TensorView& dbeta,
                         const NormOptions& opt) {
  backward("layer_norm_backward", true, comm, dy, x, gamma, mean, rstd, dx, dgamma, dbeta, opt);
}

void rms_norm_forward(Communicator& comm, const TensorView& x, const TensorView& gamma,
                      const TensorView& y, const TensorView& rstd, const NormOptions& opt) {
  forward("rms_norm_forward", false, comm, x, gamma, TensorView{}, y, TensorView{}, rstd, opt);
}

void rms_norm_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                       const TensorView& gamma, const TensorView& rstd, const TensorView& dx,
                       const TensorView& dgamma, const NormOptions& opt) {
  backward("rms_norm_backward", false, comm, dy, x, gamma, TensorView{}, rstd, dx, dgamma,
           TensorView{}, opt);
}

}  // namespace tpnorm
