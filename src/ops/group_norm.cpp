// group_norm.cpp — GroupNorm / InstanceNorm pipelines: validate -> per-(sample, group) partials
// of ALL groups -> ONE reduce -> apply. Nothing is written to an output before the collective
// has confirmed that every rank's arguments are valid and agree.
#include "kernels/cpu/group_norm.h"

#include <limits>
#include <string>
#include <vector>

#include "common/dispatch.h"
#include "ops/packed_call.h"
#include "ops/row_stages.h"
#include "ops/validate.h"
#include "tpnorm/group_norm.h"

namespace tpnorm {
namespace {

namespace kc = kernels::cpu;

struct Geometry {
  int64_t n = 0, c_local = 0, spatial = 1, channels = 0;
  int64_t ng = 0;  ///< N * groups: (sample, group) statistics, set by check()
  kc::GroupNormArgs args(const ChannelGroups& cg, int threads) const {
    const int64_t g = cg.groups > 0 ? cg.groups : 1;
    return {n,      c_local, spatial, cg.channel_offset, g, channels / g > 0 ? channels / g : 1,
            threads};
  }
};

Geometry geometry(const TensorView& x, const ChannelGroups& cg) {
  Geometry g;
  if (x.shape.ndim >= 2 && detail::shape_fits(x.shape)) {  // else zeros: the validator rejects x
    g.n = x.shape[0];
    g.c_local = x.shape[1];
    for (int i = 2; i < x.shape.ndim; ++i) g.spatial *= x.shape[i];
  }
  g.channels = cg.channels < 0 ? g.c_local : cg.channels;
  return g;
}

// Local checks of the grouping and the common agreement fields; returns the geometry.
Geometry check(detail::PackedCall& call, detail::Validator& v, const TensorView& x,
               const ChannelGroups& cg, const TensorView& gamma, const NormOptions& opt) {
  Geometry g = geometry(x, cg);
  detail::host_only(v, x.device) && v.usable("x", x) &&
      v.dtype_in("x", x, {DType::F32, DType::F16, DType::BF16}) &&
      (x.shape.ndim >= 2 || v.fail("x", "must be [N, C, *spatial], got " + x.shape.str())) &&
      (cg.groups >= 1 || v.fail("groups", "must be >= 1, got " + std::to_string(cg.groups))) &&
      (g.channels % cg.groups == 0 ||
       v.fail("groups", std::to_string(cg.groups) + " does not divide " +
                            std::to_string(g.channels) + " channels")) &&
      // channels - c_local, not offset + c_local: an absurd offset must not overflow.
      ((cg.channel_offset >= 0 && cg.channel_offset <= g.channels - g.c_local) ||
       v.fail("channel_offset", std::to_string(cg.channel_offset) + " + " +
                                    std::to_string(g.c_local) + " local channels exceeds " +
                                    std::to_string(g.channels)));
  call.agree("n", static_cast<double>(g.n));
  call.agree("channels", static_cast<double>(g.channels));
  call.agree("groups", static_cast<double>(cg.groups));
  call.agree("spatial", static_cast<double>(g.spatial));
  call.agree("dtype", static_cast<double>(x.dtype));
  call.agree("stats", static_cast<double>(opt.stats));
  call.agree("gamma", gamma.present() ? 1 : 0);
  // groups is the caller's number, not a dim of x: N * groups * 2 payload values must fit.
  if (cg.groups >= 1 && (__builtin_mul_overflow(g.n, cg.groups, &g.ng) ||
                         g.ng > std::numeric_limits<int64_t>::max() / 2)) {
    v.fail("groups", std::to_string(g.n) + " samples x " + std::to_string(cg.groups) +
                         " groups overflows int64");
    g.ng = 0;
  }
  // Local count: this rank's channels; summed, it must be all channels (slices tile [0, C)).
  call.prepare(static_cast<size_t>(g.ng * 2), static_cast<double>(g.c_local));
  return g;
}

void check_tiling(detail::PackedCall& call, const Geometry& g, const char* op) {
  if (call.global_count() != static_cast<double>(g.channels))
    throw Error(ErrorCode::kInvalidArgument,
                std::string("tpnorm: ") + op + ": the ranks' channel slices hold " +
                    std::to_string(static_cast<int64_t>(call.global_count())) +
                    " channels in all, expected " + std::to_string(g.channels));
}

void stats_ok(detail::Validator& v, const char* name, const TensorView& t, int64_t ng, DType dt) {
  v.optional(name, t, ng, dt) && (!t.present() || v.dtype_in(name, t, {DType::F32, DType::F64}));
}

}  // namespace

void group_norm_forward(Communicator& comm, const TensorView& x, const ChannelGroups& cg,
                        const TensorView& gamma, const TensorView& beta, const TensorView& y,
                        const TensorView& mean, const TensorView& rstd, const NormOptions& opt) {
  const char* op = "group_norm_forward";
  detail::PackedCall call(comm, op, detail::wire_of(opt.stats), opt.check_agreement);
  detail::Validator v(call, comm.device());
  v.eps(opt.eps);
  call.agree("eps", opt.eps);
  call.agree("beta", beta.present() ? 1 : 0);
  const Geometry g = check(call, v, x, cg, gamma, opt);
  const DType sdt = rstd.present() ? rstd.dtype : (mean.present() ? mean.dtype : DType::F32);
  v.usable("y", y) && v.same_shape("y", y, x.shape) && v.same_dtype("y", y, x.dtype) &&
      v.optional("gamma", gamma, g.c_local, x.dtype) &&
      v.optional("beta", beta, g.c_local, x.dtype);
  stats_ok(v, "rstd", rstd, g.ng, sdt);
  stats_ok(v, "mean", mean, g.ng, sdt);
  const kc::GroupNormArgs a = g.args(cg, opt.num_threads);
  if (!call.failed()) {
    detail::dispatch_storage(x.dtype, [&](auto t) {
      detail::dispatch_acc(call.wire(), [&](auto w) {
        using T = decltype(t);
        using W = decltype(w);
        kc::group_partial_forward<T, W>(a, static_cast<const T*>(x.data), call.payload<W>());
      });
    });
  }
  call.reduce();
  check_tiling(call, g, op);
  const double count = static_cast<double>(a.cpg) * static_cast<double>(g.spatial);
  detail::check_naive_count(opt.stats, count);
  detail::dispatch_kernel_types(x.dtype, call.wire(), sdt, [&](auto t, auto w, auto s) {
    using T = decltype(t);
    using W = decltype(w);
    using S = decltype(s);
    kc::group_apply_forward<T, W, S>(
        a, static_cast<const T*>(x.data), static_cast<const T*>(gamma.data),
        static_cast<const T*>(beta.data), call.payload<W>(), count, opt.eps,
        static_cast<T*>(y.data), static_cast<S*>(mean.data), static_cast<S*>(rstd.data));
  });
}

void group_norm_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                         const ChannelGroups& cg, const TensorView& gamma, const TensorView& mean,
                         const TensorView& rstd, const TensorView& dx, const TensorView& dgamma,
                         const TensorView& dbeta, const NormOptions& opt) {
  const char* op = "group_norm_backward";
  detail::PackedCall call(comm, op, detail::wire_of(opt.stats), opt.check_agreement);
  detail::Validator v(call, comm.device());
  const Geometry g = check(call, v, x, cg, gamma, opt);
  const int64_t ng = g.ng;
  v.usable("dy", dy) && v.same_shape("dy", dy, x.shape) && v.same_dtype("dy", dy, x.dtype) &&
      v.usable("dx", dx) && v.same_shape("dx", dx, x.shape) && v.same_dtype("dx", dx, x.dtype) &&
      v.optional("gamma", gamma, g.c_local, x.dtype) && v.usable("rstd", rstd) &&
      v.numel_is("rstd", rstd, ng) && v.dtype_in("rstd", rstd, {DType::F32, DType::F64}) &&
      v.usable("mean", mean) && v.numel_is("mean", mean, ng) &&
      v.same_dtype("mean", mean, rstd.dtype) && v.optional("dgamma", dgamma, g.c_local, x.dtype) &&
      v.optional("dbeta", dbeta, g.c_local, x.dtype);
  const kc::GroupNormArgs a = g.args(cg, opt.num_threads);
  std::vector<double> dparams(static_cast<size_t>(2 * (g.c_local > 0 ? g.c_local : 0)));
  auto run = [&](auto&& body) {
    detail::dispatch_kernel_types(x.dtype, call.wire(), rstd.dtype, body);
  };
  if (!call.failed()) {
    run([&](auto t, auto w, auto s) {
      using T = decltype(t);
      using W = decltype(w);
      using S = decltype(s);
      kc::group_partial_backward<T, W, S>(
          a, static_cast<const T*>(dy.data), static_cast<const T*>(x.data),
          static_cast<const T*>(gamma.data), static_cast<const S*>(mean.data),
          static_cast<const S*>(rstd.data), call.payload<W>(), dparams.data());
    });
  }
  call.reduce();
  check_tiling(call, g, op);
  const double count = static_cast<double>(a.cpg) * static_cast<double>(g.spatial);
  detail::check_naive_count(opt.stats, count);
  run([&](auto t, auto w, auto s) {
    using T = decltype(t);
    using W = decltype(w);
    using S = decltype(s);
    kc::group_apply_backward<T, W, S>(
        a, static_cast<const T*>(dy.data), static_cast<const T*>(x.data),
        static_cast<const T*>(gamma.data), static_cast<const S*>(mean.data),
        static_cast<const S*>(rstd.data), call.payload<W>(), count, dparams.data(),
        static_cast<T*>(dx.data), static_cast<T*>(dgamma.data), static_cast<T*>(dbeta.data));
  });
}

namespace {
ChannelGroups per_channel(const TensorView& x, ChannelGroups cg) {
  cg.groups = cg.channels >= 0 ? cg.channels : (x.shape.ndim >= 2 ? x.shape[1] : 1);
  if (cg.groups < 1) cg.groups = 1;  // C = 0 everywhere: nothing to normalize
  return cg;
}
}  // namespace

void instance_norm_forward(Communicator& comm, const TensorView& x, const ChannelGroups& cg,
                           const TensorView& gamma, const TensorView& beta, const TensorView& y,
                           const TensorView& mean, const TensorView& rstd, const NormOptions& opt) {
  group_norm_forward(comm, x, per_channel(x, cg), gamma, beta, y, mean, rstd, opt);
}

void instance_norm_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                            const ChannelGroups& cg, const TensorView& gamma,
                            const TensorView& mean, const TensorView& rstd, const TensorView& dx,
                            const TensorView& dgamma, const TensorView& dbeta,
                            const NormOptions& opt) {
  group_norm_backward(comm, dy, x, per_channel(x, cg), gamma, mean, rstd, dx, dgamma, dbeta, opt);
}

}  // namespace tpnorm
