// batch_norm.cpp — the SyncBatchNorm pipelines (see tpnorm/batch_norm.h for the semantics).
//
// Training: validate -> per-channel partials -> ONE reduce (count in the call header: an exact
// integer in the float64 wire, checked below 2^24 in the float32 naive wire) -> apply.
// Eval with running statistics: validate -> apply, with no collective at all; its arguments
// are checked on a single-process PackedCall so the communicator's call sequence only counts
// collectives. Nothing is written to an output, saved or running statistic before the call
// is known to succeed on every rank.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/dispatch.h"
#include "kernels/cpu/batch_norm.h"
#include "ops/packed_call.h"
#include "ops/validate.h"
#include "tpnorm/batch_norm.h"
#ifdef TPNORM_WITH_CUDA
#include "ops/cuda/batch_norm_cuda.h"
#endif

namespace tpnorm {
namespace {

namespace kc = kernels::cpu;
using detail::dispatch_acc;
using detail::dispatch_storage;

kc::BatchNormArgs geometry(const TensorView& x, const BatchNormOptions& opt) {
  kc::BatchNormArgs a;
  a.channels_last = opt.layout == Layout::kChannelsLast;
  a.threads = opt.num_threads;
  if (x.shape.ndim < 2 || !detail::shape_fits(x.shape)) return a;  // zeros: the validator rejects x
  a.n = x.shape[0];
  const int cdim = a.channels_last ? x.shape.ndim - 1 : 1;
  a.c = x.shape[cdim];
  for (int i = 1; i < x.shape.ndim; ++i)
    if (i != cdim) a.inner *= x.shape[i];
  return a;
}

DType wire_of(Stats s) { return s == Stats::kNaive ? DType::F32 : DType::F64; }

// A view of [C] statistics: float32 or float64.
bool stat_view(detail::Validator& v, const char* name, const TensorView& t, int64_t c) {
  return v.usable(name, t) && v.numel_is(name, t, c) &&
         v.dtype_in(name, t, {DType::F32, DType::F64});
}

// x: [N, C, *spatial] or [N, *spatial, C] of a storage dtype.
bool check_x(detail::Validator& v, const TensorView& x) {
  return v.usable("x", x) && v.dtype_in("x", x, {DType::F32, DType::F16, DType::BF16}) &&
         (x.shape.ndim >= 2 || v.fail("x", "has shape " + x.shape.str() + ", expected [N, C, ...]"));
}

void agree_common(detail::PackedCall& call, const TensorView& x, const kc::BatchNormArgs& a,
                  const BatchNormOptions& opt) {
  call.agree("channels", static_cast<double>(a.c));
  call.agree("dtype", static_cast<double>(x.dtype));
  call.agree("layout", static_cast<double>(opt.layout));
  call.agree("stats", static_cast<double>(opt.stats));
}

void check_count(detail::PackedCall& call, const BatchNormOptions& opt, const char* op) {
  if (opt.stats == Stats::kNaive && call.global_count() >= detail::kNaiveCountLimit)
    throw Error(ErrorCode::kInvalidArgument,
                std::string("tpnorm: ") + op +
                    ": the naive statistics mode supports fewer than 2^24 values per channel; "
                    "use Stats::kRobust");
}

template <class S>
void store(const TensorView& t, const std::vector<double>& v) {
  S* p = static_cast<S*>(t.data);
  for (size_t i = 0; i < v.size(); ++i) p[i] = static_cast<S>(v[i]);
}
void store_stat(const TensorView& t, const std::vector<double>& v) {
  if (!t.present()) return;
  dispatch_acc(t.dtype, [&](auto s) { store<decltype(s)>(t, v); });
}
#ifndef TPNORM_WITH_CUDA
// Without the CUDA backend a device communicator can only be a stream-less single-rank one.
void require_host(const Communicator& comm, const char* op) {
  if (comm.device().kind != DeviceKind::CPU)
    throw Error(ErrorCode::kInvalidArgument,
                std::string("tpnorm: ") + op + ": this build has no CUDA backend");
}
#endif

std::vector<double> load_stat(const TensorView& t, int64_t c) {
  std::vector<double> v(c);
  dispatch_acc(t.dtype, [&](auto s) {
    const auto* p = static_cast<const decltype(s)*>(t.data);
    for (int64_t i = 0; i < c; ++i) v[i] = static_cast<double>(p[i]);
  });
  return v;
}

}  // namespace

void sync_batch_norm_forward(Communicator& comm, const TensorView& x, const TensorView& gamma,
                             const TensorView& beta, const TensorView& running_mean,
                             const TensorView& running_var, int64_t* num_batches_tracked,
                             const TensorView& y, const TensorView& save_mean,
                             const TensorView& save_invstd, const BatchNormOptions& opt) {
  static const char* kOp = "sync_batch_norm_forward";
  const bool tracking = running_mean.present() || running_var.present();
  const bool batch_stats = opt.training || !tracking;  // eval without running stats: batch
  const bool cumulative = std::isnan(opt.momentum);
  const kc::BatchNormArgs a = geometry(x, opt);

  // Eval with running statistics communicates nothing, so it validates on a local call.
  std::unique_ptr<Communicator> local = batch_stats ? nullptr : make_single_communicator();
  detail::PackedCall call(batch_stats ? comm : *local, kOp, wire_of(opt.stats),
                          opt.check_agreement);
  detail::Validator v(call, comm.device());
  check_x(v, x) && v.eps(opt.eps) && v.usable("y", y) && v.same_shape("y", y, x.shape) &&
      v.same_dtype("y", y, x.dtype) && v.optional("gamma", gamma, a.c, x.dtype) &&
      v.optional("beta", beta, a.c, x.dtype) &&
      (!tracking || (stat_view(v, "running_mean", running_mean, a.c) &&
                     stat_view(v, "running_var", running_var, a.c) &&
                     v.same_dtype("running_var", running_var, running_mean.dtype))) &&
      (!save_mean.present() || stat_view(v, "save_mean", save_mean, a.c)) &&
      (!save_invstd.present() || stat_view(v, "save_invstd", save_invstd, a.c)) &&
      (cumulative || std::isfinite(opt.momentum) ||
       v.fail("momentum", "must be finite or NaN (cumulative average)")) &&
      (!(opt.training && tracking && cumulative) || num_batches_tracked ||
       v.fail("num_batches_tracked", "is required by momentum \"none\" (cumulative average)"));
  agree_common(call, x, a, opt);
  call.agree("eps", opt.eps);
  call.agree("training", opt.training ? 1 : 0);
  call.agree("momentum", cumulative ? -1.0 : opt.momentum);
  call.agree("running stats", tracking ? 1 : 0);
  call.agree("gamma", gamma.present() ? 1 : 0);
  call.agree("beta", beta.present() ? 1 : 0);
#ifdef TPNORM_WITH_CUDA
  if (comm.device().kind == DeviceKind::CUDA)
    return detail::sync_batch_norm_forward_cuda(comm, call, a, batch_stats, tracking, x, gamma,
                                                beta, running_mean, running_var,
                                                num_batches_tracked, y, save_mean, save_invstd,
                                                opt);
#else
  require_host(comm, kOp);
#endif

  std::vector<double> mean(a.c), invstd(a.c), var(a.c);
  if (batch_stats) {
    // Same payload length on every rank that agrees on the channels, failed or not.
    call.prepare(static_cast<size_t>(2 * a.c), static_cast<double>(a.n * a.inner));
    if (!call.failed()) {
      dispatch_storage(x.dtype, [&](auto t) {
        dispatch_acc(call.wire(), [&](auto w) {
          using T = decltype(t);
          using W = decltype(w);
          kc::bn_partial_forward<T, W>(a, static_cast<const T*>(x.data), call.payload<W>());
        });
      });
    }
    call.reduce();
    check_count(call, opt, kOp);
    const double n = call.global_count();
    if (n <= 1)  // the same n on every rank, so every rank throws here together
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("tpnorm: ") + kOp + ": expected more than 1 value per channel " +
                      "over all ranks, got " + std::to_string(static_cast<int64_t>(n)));
    dispatch_acc(call.wire(), [&](auto w) {
      kc::bn_moments(a.c, call.payload<decltype(w)>(), n, mean.data(), var.data());
    });
    if (opt.training && tracking) {
      int64_t tracked = num_batches_tracked ? *num_batches_tracked + 1 : 0;
      const double m = cumulative ? 1.0 / static_cast<double>(tracked) : opt.momentum;
      std::vector<double> rm = load_stat(running_mean, a.c), rv = load_stat(running_var, a.c);
      for (int64_t c = 0; c < a.c; ++c) {
        rm[c] = (1 - m) * rm[c] + m * mean[c];
        rv[c] = (1 - m) * rv[c] + m * var[c] * n / (n - 1);  // unbiased, as PyTorch
      }
      store_stat(running_mean, rm);
      store_stat(running_var, rv);
      if (num_batches_tracked) *num_batches_tracked = tracked;
    }
  } else {
    call.throw_if_failed_locally(comm.rank());
    mean = load_stat(running_mean, a.c);
    var = load_stat(running_var, a.c);
  }
  for (int64_t c = 0; c < a.c; ++c) invstd[c] = 1.0 / std::sqrt(var[c] + opt.eps);
  dispatch_storage(x.dtype, [&](auto t) {
    using T = decltype(t);
    kc::bn_apply_forward<T, double>(a, static_cast<const T*>(x.data),
                                    static_cast<const T*>(gamma.data),
                                    static_cast<const T*>(beta.data), mean.data(), invstd.data(),
                                    static_cast<T*>(y.data));
  });
  store_stat(save_mean, mean);
  store_stat(save_invstd, invstd);
}

void sync_batch_norm_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                              const TensorView& gamma, const TensorView& save_mean,
                              const TensorView& save_invstd, const TensorView& dx,
                              const TensorView& dgamma, const TensorView& dbeta,
                              const BatchNormOptions& opt) {
  static const char* kOp = "sync_batch_norm_backward";
  const kc::BatchNormArgs a = geometry(x, opt);
  std::unique_ptr<Communicator> local = opt.training ? nullptr : make_single_communicator();
  detail::PackedCall call(opt.training ? comm : *local, kOp, wire_of(opt.stats),
                          opt.check_agreement);
  detail::Validator v(call, comm.device());
  check_x(v, x) && v.usable("dy", dy) && v.same_shape("dy", dy, x.shape) &&
      v.same_dtype("dy", dy, x.dtype) && v.usable("dx", dx) && v.same_shape("dx", dx, x.shape) &&
      v.same_dtype("dx", dx, x.dtype) && v.optional("gamma", gamma, a.c, x.dtype) &&
      stat_view(v, "save_mean", save_mean, a.c) &&
      stat_view(v, "save_invstd", save_invstd, a.c) &&
      v.same_dtype("save_invstd", save_invstd, save_mean.dtype) &&
      v.optional("dgamma", dgamma, a.c, x.dtype) && v.optional("dbeta", dbeta, a.c, x.dtype);
  agree_common(call, x, a, opt);
  call.agree("training", opt.training ? 1 : 0);
  call.agree("gamma", gamma.present() ? 1 : 0);
#ifdef TPNORM_WITH_CUDA
  if (comm.device().kind == DeviceKind::CUDA)
    return detail::sync_batch_norm_backward_cuda(comm, call, a, dy, x, gamma, save_mean,
                                                 save_invstd, dx, dgamma, dbeta, opt);
#else
  require_host(comm, kOp);
#endif

  call.prepare(static_cast<size_t>(2 * a.c), static_cast<double>(a.n * a.inner));
  if (!opt.training) call.throw_if_failed_locally(comm.rank());
  auto run = [&](auto&& body) {
    detail::dispatch_kernel_types(x.dtype, call.wire(), save_mean.dtype, body);
  };
  // This rank's partials, kept for dgamma / dbeta (local sums) before the payload is summed.
  std::vector<double> local_stats(static_cast<size_t>(2 * a.c));
  if (!call.failed()) {
    run([&](auto t, auto w, auto s) {
      using T = decltype(t);
      using W = decltype(w);
      using S = decltype(s);
      W* p = call.payload<W>();
      kc::bn_partial_backward<T, W, S>(a, static_cast<const T*>(dy.data),
                                       static_cast<const T*>(x.data),
                                       static_cast<const S*>(save_mean.data), p);
      for (size_t i = 0; i < local_stats.size(); ++i) local_stats[i] = p[i];
    });
  }
  double n = 0;
  if (opt.training) {
    call.reduce();
    check_count(call, opt, kOp);
    n = call.global_count();
  } else {
    // Eval: mean and invstd are constants, so dx = gamma*invstd*dy (zero global sums).
    run([&](auto, auto w, auto) {
      std::fill_n(call.payload<decltype(w)>(), 2 * a.c, decltype(w)(0));
    });
  }
  run([&](auto t, auto w, auto s) {
    using T = decltype(t);
    using W = decltype(w);
    using S = decltype(s);
    kc::bn_apply_backward<T, W, S>(a, static_cast<const T*>(dy.data),
                                   static_cast<const T*>(x.data),
                                   static_cast<const T*>(gamma.data),
                                   static_cast<const S*>(save_mean.data),
                                   static_cast<const S*>(save_invstd.data), call.payload<W>(), n,
                                   static_cast<T*>(dx.data));
    kc::bn_param_grads<T, double, S>(a.c, local_stats.data(),
                                     static_cast<const S*>(save_invstd.data),
                                     static_cast<T*>(dgamma.data), static_cast<T*>(dbeta.data));
  });
}

}  // namespace tpnorm
