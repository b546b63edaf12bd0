// group_norm.cpp — the GroupNorm / InstanceNorm specs (see tpnorm/group_norm.h): the partial
// holds per-(sample, group) statistics of ALL groups, of which this rank adds its channels'
// share; after the ONE reduce the apply checks that the ranks' channel slices tile [0, C).
// InstanceNorm is GroupNorm with one channel per group.
#include "tpnorm/group_norm.h"

#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "common/dispatch.h"
#include "common/exact_sum.h"
#include "kernels/cpu/exact_groups.h"
#include "kernels/cpu/group_norm.h"
#include "ops/device_hooks.h"
#include "ops/op_spec.h"

namespace tpnorm {
namespace detail {
namespace {

namespace kc = kernels::cpu;

struct Geometry {
  int64_t n = 0, c_local = 0, spatial = 1, channels = 0;
  int64_t ng = 0;             ///< N * groups: (sample, group) statistics
  bool ng_overflows = false;  ///< N * groups * 2 payload values exceed int64
};

// Zeros for a shape the validator rejects (see shape_fits).
Geometry geometry(const TensorView& x, const ChannelGroups& cg) {
  Geometry g;
  if (x.shape.ndim >= 2 && shape_fits(x.shape)) {
    g.n = x.shape[0];
    g.c_local = x.shape[1];
    for (int i = 2; i < x.shape.ndim; ++i) g.spatial *= x.shape[i];
  }
  g.channels = cg.channels < 0 ? g.c_local : cg.channels;
  // groups is the caller's number, not a dim of x: N * groups * 2 payload values must fit.
  if (cg.groups >= 1 && (__builtin_mul_overflow(g.n, cg.groups, &g.ng) ||
                         g.ng > std::numeric_limits<int64_t>::max() / 2)) {
    g.ng_overflows = true;
    g.ng = 0;
  }
  return g;
}

kc::GroupNormArgs kernel_args(const Geometry& g, const ChannelGroups& cg, int threads) {
  const int64_t groups = cg.groups > 0 ? cg.groups : 1;
  const int64_t cpg = g.channels / groups > 0 ? g.channels / groups : 1;
  return {g.n, g.c_local, g.spatial, cg.channel_offset, groups, cpg, threads};
}

// What the forward and backward calls share: x and its grouping, computed once.
struct Grouping {
  TensorView x;
  ChannelGroups cg;
  TensorView gamma;
  NormOptions opt;
  Geometry g = geometry(x, cg);
  kc::GroupNormArgs k = kernel_args(g, cg, opt.num_threads);
};

struct GroupForward {
  Grouping grp;
  TensorView beta, y, mean, rstd;
  bool instance = false;  ///< InstanceNorm: one spatial element is refused, as torch does
};

struct GroupBackward {
  Grouping grp;
  TensorView dy, mean, rstd, dx, dgamma, dbeta;
};

void validate_grouping(Validator& v, const Grouping& grp) {
  const ChannelGroups& cg = grp.cg;
  const Geometry& g = grp.g;
  v.usable("x", grp.x);
  v.storage("x", grp.x);
  if (grp.x.shape.ndim < 2) v.fail("x", "must be [N, C, *spatial], got " + grp.x.shape.str());
  if (cg.groups < 1) v.fail("groups", "must be >= 1, got " + std::to_string(cg.groups));
  if (v.ok() && g.channels % cg.groups != 0)  // groups >= 1 here
    v.fail("groups", std::to_string(cg.groups) + " does not divide " + std::to_string(g.channels) +
                         " channels");
  // channels - c_local, not offset + c_local: an absurd offset must not overflow.
  if (v.ok() && (cg.channel_offset < 0 || cg.channel_offset > g.channels - g.c_local))
    v.fail("channel_offset", std::to_string(cg.channel_offset) + " + " + std::to_string(g.c_local) +
                                 " local channels exceeds " + std::to_string(g.channels));
  if (g.ng_overflows)
    v.fail("groups", std::to_string(g.n) + " samples x " + std::to_string(cg.groups) +
                         " groups overflows int64");
}

void agree_grouping(PackedCall& call, const Grouping& grp) {
  call.agree("n", static_cast<double>(grp.g.n));
  call.agree("channels", static_cast<double>(grp.g.channels));
  call.agree("groups", static_cast<double>(grp.cg.groups));
  call.agree("spatial", static_cast<double>(grp.g.spatial));
  call.agree("dtype", static_cast<double>(grp.x.dtype));
  call.agree("stats", static_cast<double>(grp.opt.stats));
  call.agree("gamma", grp.gamma.present() ? 1 : 0);
}

// 2 values per (sample, group); the local count is this rank's channels, which summed over the
// ranks must be all channels, and the slice table says where they are (the slices tile [0, C)).
// Stats::kExact: int64 limbs of each slot's exact sums instead (kernels/cpu/exact_groups.h).
PayloadSize grouping_payload(const Grouping& grp, bool forward) {
  const int per = grp.opt.stats == Stats::kExact ? tpnorm::exact::moment_limbs(forward) : 2;
  PayloadSize p{static_cast<size_t>(grp.g.ng * per), static_cast<double>(grp.g.c_local)};
  p.slice = {"channel", grp.cg.channel_offset, grp.g.c_local, grp.g.channels};
  return p;
}

// Elements per group, checked against the naive mode's limit (every rank agrees on it).
double group_count(const Grouping& grp, const char* op) {
  const double count = static_cast<double>(grp.k.cpg) * static_cast<double>(grp.g.spatial);
  check_naive_count(grp.opt.stats, count, op, "group");
  return count;
}

// After the reduce on the host: the ranks' channel slices must tile [0, C). (The device hooks
// check the tiling on device, where the summed header is, and take group_count directly.)
double checked_count(const PackedCall& call, const Grouping& grp, const char* op) {
  if (call.global_count() != static_cast<double>(grp.g.channels))
    throw Error(ErrorCode::kInvalidArgument,
                std::string("tpnorm: ") + op + ": the ranks' channel slices hold " +
                    std::to_string(static_cast<int64_t>(call.global_count())) +
                    " channels in all, expected " + std::to_string(grp.g.channels));
  return group_count(grp, op);
}

#ifdef TPNORM_WITH_CUDA
void forward_partial_device(PackedCall& call, DeviceCommunicator& dev, const GroupForward& a) {
  group_forward_partial_cuda(call, dev, a.grp.k, a.grp.x, a.grp.opt);
}
void forward_apply_device(PackedCall& call, DeviceCommunicator& dev, const GroupForward& a) {
  const Grouping& grp = a.grp;
  group_forward_apply_cuda(call, dev, grp.k, grp.g.channels, group_count(grp, "group_norm_forward"),
                           grp.x, grp.gamma, a.beta, a.y, a.mean, a.rstd, grp.opt);
}
void backward_partial_device(PackedCall& call, DeviceCommunicator& dev, const GroupBackward& a) {
  group_backward_partial_cuda(call, dev, a.grp.k, a.dy, a.grp.x, a.grp.gamma, a.mean, a.rstd);
}
void backward_apply_device(PackedCall& call, DeviceCommunicator& dev, const GroupBackward& a) {
  const Grouping& grp = a.grp;
  group_backward_apply_cuda(call, dev, grp.k, grp.g.channels,
                            group_count(grp, "group_norm_backward"), a.dy, grp.x, grp.gamma, a.mean,
                            a.rstd, a.dx, a.dgamma, a.dbeta);
}
PayloadSize device_payload(const Grouping& grp, bool forward) {
  PayloadSize p = grouping_payload(grp, forward);
  p.device_scratch = group_scratch_cuda(grp.k);
  return p;
}
#else
PayloadSize device_payload(const Grouping& grp, bool forward) {
  return grouping_payload(grp, forward);
}
#endif
constexpr DeviceHooks<GroupForward> kForwardDevice =
    TPNORM_DEVICE_HOOKS_EXACT(forward_partial_device, forward_apply_device);
constexpr DeviceHooks<GroupBackward> kBackwardDevice =
    TPNORM_DEVICE_HOOKS_EXACT(backward_partial_device, backward_apply_device);

class GroupForwardOp final : public SpecOf<GroupForward> {
 public:
  using SpecOf::SpecOf;

  void validate(Validator& v) const override {
    const Grouping& grp = args_.grp;
    const DType saved = saved_dtype(args_.mean, args_.rstd);
    v.eps(grp.opt.eps);
    validate_grouping(v, grp);
    // torch's F.instance_norm refuses it (its statistics would be the element itself: y = 0);
    // spatial is agreed, so every rank fails here together.
    if (v.ok() && args_.instance && grp.g.spatial == 1 && grp.g.n * grp.g.channels > 0)
      v.fail("x", "has one spatial element per channel (" + grp.x.shape.str() +
                      "): InstanceNorm expects more than 1 spatial element when training");
    v.like("y", args_.y, grp.x);
    v.optional("gamma", grp.gamma, grp.g.c_local, grp.x.dtype);
    v.optional("beta", args_.beta, grp.g.c_local, grp.x.dtype);
    v.optional_stats("rstd", args_.rstd, grp.g.ng, saved);
    v.optional_stats("mean", args_.mean, grp.g.ng, saved);
  }
  void agree(PackedCall& call) const override {
    call.agree("eps", args_.grp.opt.eps);
    call.agree("beta", args_.beta.present() ? 1 : 0);
    agree_grouping(call, args_.grp);
  }
  PayloadSize payload() const override { return device_payload(args_.grp, true); }
  void partial(PackedCall& call) override {
    const Grouping& grp = args_.grp;
    dispatch_forward_partial(
        grp.x, call.wire(), call.payload_data(),
        [&](const auto* x, int64_t* limbs) { kc::group_exact_partial_forward(grp.k, x, limbs); },
        [&](const auto* x, auto* sums) { kc::group_partial_forward(grp.k, x, sums); });
  }
  void apply(PackedCall& call) override {
    const Grouping& grp = args_.grp;
    const GroupForward& a = args_;
    const double count = checked_count(call, grp, name());
    // Stats::kExact: the summed limbs become each slot's final {mean, variance}.
    kc::GroupNormArgs k = grp.k;
    std::vector<double> exact;
    void* stats = call.payload_data();
    DType wire = call.wire();
    if (wire == DType::I64) {
      exact.resize(static_cast<size_t>(2 * grp.g.ng));
      kc::exact_group_finish(k, true, call.payload<int64_t>(), count, exact.data());
      k.final_stats = true;
      stats = exact.data();
      wire = DType::F64;
    }
    dispatch_kernel_types(
        grp.x.dtype, wire, saved_dtype(a.mean, a.rstd), [&](auto t, auto w, auto s) {
          using T = decltype(t);
          using W = decltype(w);
          using S = decltype(s);
          kc::group_apply_forward<T, W, S>(
              k, static_cast<const T*>(grp.x.data), static_cast<const T*>(grp.gamma.data),
              static_cast<const T*>(a.beta.data), static_cast<W*>(stats), count, grp.opt.eps,
              static_cast<T*>(a.y.data), static_cast<S*>(a.mean.data),
              static_cast<S*>(a.rstd.data));
        });
  }
};

class GroupBackwardOp final : public SpecOf<GroupBackward> {
 public:
  using SpecOf::SpecOf;

  void validate(Validator& v) const override {
    const Grouping& grp = args_.grp;
    validate_grouping(v, grp);
    v.like("dy", args_.dy, grp.x);
    v.like("dx", args_.dx, grp.x);
    v.optional("gamma", grp.gamma, grp.g.c_local, grp.x.dtype);
    v.stats("rstd", args_.rstd, grp.g.ng);
    v.stats_like("mean", args_.mean, grp.g.ng, args_.rstd);
    v.optional("dgamma", args_.dgamma, grp.g.c_local, grp.x.dtype);
    v.optional("dbeta", args_.dbeta, grp.g.c_local, grp.x.dtype);
  }
  void agree(PackedCall& call) const override { agree_grouping(call, args_.grp); }
  PayloadSize payload() const override { return device_payload(args_.grp, false); }
  // This rank's dgamma / dbeta partial sums stay local (they are per local channel).
  void partial(PackedCall& call) override {
    const int64_t c_local = args_.grp.g.c_local;
    dparams_.assign(static_cast<size_t>(2 * (c_local > 0 ? c_local : 0)), 0.0);
    if (call.wire() == DType::I64)
      return dispatch(call, [&](auto in, auto*) {
        if constexpr (has_exact_kernels<decltype(*in.x)>)
          kc::group_exact_partial_backward(args_.grp.k, in.dy, in.x, in.gamma, in.mean, in.rstd,
                                           call.payload<int64_t>(), dparams_.data());
      });
    dispatch(call, [&](auto in, auto* stats) {
      kc::group_partial_backward(args_.grp.k, in.dy, in.x, in.gamma, in.mean, in.rstd, stats,
                                 dparams_.data());
    });
  }
  void apply(PackedCall& call) override {
    double count = checked_count(call, args_.grp, name());
    // Stats::kExact: each slot's sums divided by the count, rounded once; then count = 1.
    std::vector<double> exact;
    if (call.wire() == DType::I64) {
      exact.resize(static_cast<size_t>(2 * args_.grp.g.ng));
      kc::exact_group_finish(args_.grp.k, false, call.payload<int64_t>(), count, exact.data());
      count = 1;
    }
    dispatch(call, [&](auto in, auto* wire_stats) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(in.x)>>;
      const auto* stats = wire_stats;
      if constexpr (std::is_same_v<std::remove_const_t<std::remove_pointer_t<decltype(stats)>>,
                                   double>)
        if (!exact.empty()) stats = exact.data();
      kc::group_apply_backward(args_.grp.k, in.dy, in.x, in.gamma, in.mean, in.rstd, stats, count,
                               dparams_.data(), static_cast<T*>(args_.dx.data),
                               static_cast<T*>(args_.dgamma.data),
                               static_cast<T*>(args_.dbeta.data));
    });
  }

 private:
  // The backward's inputs, typed: what its partial and apply kernels both read.
  template <class T, class S>
  struct In {
    const T* dy;
    const T* x;
    const T* gamma;
    const S* mean;
    const S* rstd;
  };
  // fn(In<T, S>, W* payload) for the call's storage, wire and saved-statistics types.
  // (Stats::kExact: W = double, whose payload pointer the exact branches do not read as such.)
  template <class Fn>
  void dispatch(PackedCall& call, Fn&& fn) {
    const GroupBackward& a = args_;
    const DType wire = call.wire() == DType::I64 ? DType::F64 : call.wire();
    dispatch_kernel_types(a.grp.x.dtype, wire, a.rstd.dtype, [&](auto t, auto w, auto s) {
      using T = decltype(t);
      using S = decltype(s);
      fn(In<T, S>{static_cast<const T*>(a.dy.data), static_cast<const T*>(a.grp.x.data),
                  static_cast<const T*>(a.grp.gamma.data), static_cast<const S*>(a.mean.data),
                  static_cast<const S*>(a.rstd.data)},
         call.payload<decltype(w)>());
    });
  }

  std::vector<double> dparams_;
};

}  // namespace
}  // namespace detail

namespace {

ChannelGroups per_channel(const TensorView& x, ChannelGroups cg) {
  cg.groups = cg.channels >= 0 ? cg.channels : (x.shape.ndim >= 2 ? x.shape[1] : 1);
  if (cg.groups < 1) cg.groups = 1;  // C = 0 everywhere: nothing to normalize
  return cg;
}

PendingCall start_forward(Communicator& comm, const TensorView& x, const ChannelGroups& cg,
                          const TensorView& gamma, const TensorView& beta, const TensorView& y,
                          const TensorView& mean, const TensorView& rstd, const NormOptions& opt,
                          bool instance) {
  return detail::start_op(
      comm, std::make_unique<detail::GroupForwardOp>(
                "group_norm_forward", opt,
                detail::GroupForward{{x, cg, gamma, opt}, beta, y, mean, rstd, instance},
                detail::kForwardDevice));
}

}  // namespace

PendingCall group_norm_forward_start(Communicator& comm, const TensorView& x,
                                     const ChannelGroups& cg, const TensorView& gamma,
                                     const TensorView& beta, const TensorView& y,
                                     const TensorView& mean, const TensorView& rstd,
                                     const NormOptions& opt) {
  return start_forward(comm, x, cg, gamma, beta, y, mean, rstd, opt, false);
}

void group_norm_forward(Communicator& comm, const TensorView& x, const ChannelGroups& cg,
                        const TensorView& gamma, const TensorView& beta, const TensorView& y,
                        const TensorView& mean, const TensorView& rstd, const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  group_norm_forward_start(comm, x, cg, gamma, beta, y, mean, rstd, opt).finish();
}

PendingCall group_norm_backward_start(Communicator& comm, const TensorView& dy, const TensorView& x,
                                      const ChannelGroups& cg, const TensorView& gamma,
                                      const TensorView& mean, const TensorView& rstd,
                                      const TensorView& dx, const TensorView& dgamma,
                                      const TensorView& dbeta, const NormOptions& opt) {
  return detail::start_op(
      comm, std::make_unique<detail::GroupBackwardOp>(
                "group_norm_backward", opt,
                detail::GroupBackward{{x, cg, gamma, opt}, dy, mean, rstd, dx, dgamma, dbeta},
                detail::kBackwardDevice));
}

void group_norm_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                         const ChannelGroups& cg, const TensorView& gamma, const TensorView& mean,
                         const TensorView& rstd, const TensorView& dx, const TensorView& dgamma,
                         const TensorView& dbeta, const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  group_norm_backward_start(comm, dy, x, cg, gamma, mean, rstd, dx, dgamma, dbeta, opt).finish();
}

PendingCall instance_norm_forward_start(Communicator& comm, const TensorView& x,
                                        const ChannelGroups& cg, const TensorView& gamma,
                                        const TensorView& beta, const TensorView& y,
                                        const TensorView& mean, const TensorView& rstd,
                                        const NormOptions& opt) {
  return start_forward(comm, x, per_channel(x, cg), gamma, beta, y, mean, rstd, opt, true);
}

void instance_norm_forward(Communicator& comm, const TensorView& x, const ChannelGroups& cg,
                           const TensorView& gamma, const TensorView& beta, const TensorView& y,
                           const TensorView& mean, const TensorView& rstd, const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  instance_norm_forward_start(comm, x, cg, gamma, beta, y, mean, rstd, opt).finish();
}

PendingCall instance_norm_backward_start(Communicator& comm, const TensorView& dy,
                                         const TensorView& x, const ChannelGroups& cg,
                                         const TensorView& gamma, const TensorView& mean,
                                         const TensorView& rstd, const TensorView& dx,
                                         const TensorView& dgamma, const TensorView& dbeta,
                                         const NormOptions& opt) {
  return group_norm_backward_start(comm, dy, x, per_channel(x, cg), gamma, mean, rstd, dx, dgamma,
                                   dbeta, opt);
}

void instance_norm_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                            const ChannelGroups& cg, const TensorView& gamma,
                            const TensorView& mean, const TensorView& rstd, const TensorView& dx,
                            const TensorView& dgamma, const TensorView& dbeta,
                            const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  instance_norm_backward_start(comm, dy, x, cg, gamma, mean, rstd, dx, dgamma, dbeta, opt).finish();
}

}  // namespace tpnorm
