// rms_norm_gated.cpp — the gated RMSNorm specs (see tpnorm/rms_norm_gated.h): the partial holds
// one statistic of every (row, group), of which this rank adds its channels' share; after the
// ONE reduce the apply checks that the ranks' channel slices tile [0, hidden). The structure is
// GroupNorm's (group_norm.cpp) on rows instead of samples, with RMS statistics.
#include "tpnorm/rms_norm_gated.h"

#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "common/dispatch.h"
#include "kernels/cpu/exact_rows.h"
#include "kernels/cpu/rms_norm_gated.h"
#include "ops/device_hooks.h"
#include "ops/op_spec.h"
#include "tpnorm/error.h"

namespace tpnorm {
namespace detail {
namespace {

namespace kc = kernels::cpu;

struct Geometry {
  int64_t rows = 0, c_local = 0, hidden = 0, group_size = 0;
  int64_t groups = 0;           ///< hidden / group_size (0 when group_size does not divide)
  int64_t slots = 0;            ///< rows * groups: (row, group) statistics
  bool slots_overflow = false;  ///< rows * groups * 8 payload values exceed int64
};

// Zeros for a shape the validator rejects (see shape_fits).
Geometry geometry(const TensorView& x, const GatedGroups& gg) {
  Geometry g;
  if (x.shape.ndim >= 1 && shape_fits(x.shape)) {
    g.c_local = x.shape[x.shape.ndim - 1];
    g.rows = 1;
    for (int i = 0; i + 1 < x.shape.ndim; ++i) g.rows *= x.shape[i];
  }
  g.hidden = gg.hidden < 0 ? g.c_local : gg.hidden;
  g.group_size = gg.group_size < 0 ? g.hidden : gg.group_size;
  if (g.group_size >= 1 && g.hidden % g.group_size == 0) g.groups = g.hidden / g.group_size;
  // groups comes from the caller's numbers, not from x: rows * groups * 8 limbs must fit.
  if (__builtin_mul_overflow(g.rows, g.groups, &g.slots) ||
      g.slots > std::numeric_limits<int64_t>::max() / 8) {
    g.slots_overflow = true;
    g.slots = 0;
  }
  return g;
}

// What the forward and backward calls share: x, the gate and the grouping, computed once.
struct Gating {
  TensorView x, z;
  GatedGroups gg;
  TensorView weight;
  NormOptions opt;
  DType param = DType::F32;  ///< weight / dweight dtype (param_dtype)
  Geometry g = geometry(x, gg);
  kc::GatedArgs k{
      g.rows,   g.c_local,           gg.offset,      g.group_size > 0 ? g.group_size : 1,
      g.groups, gg.norm_before_gate, opt.num_threads};
};

struct GatedForward {
  Gating gt;
  TensorView y, rstd;
};

struct GatedBackward {
  Gating gt;
  TensorView dy, rstd, dx, dz, dweight;
};

void validate_gating(Validator& v, const Gating& gt) {
  const Geometry& g = gt.g;
  v.usable("x", gt.x);
  v.storage("x", gt.x);
  if (gt.x.shape.ndim < 1) v.fail("x", "must be [rows..., c_local], got " + gt.x.shape.str());
  if (gt.z.present()) v.like("z", gt.z, gt.x);
  if (v.ok() && g.hidden > 0 && g.group_size < 1)
    v.fail("group_size",
           "must be >= 1 or -1 (all channels), got " + std::to_string(gt.gg.group_size));
  if (v.ok() && g.hidden > 0 && g.hidden % g.group_size != 0)
    v.fail("group_size", std::to_string(g.group_size) + " does not divide " +
                             std::to_string(g.hidden) + " channels");
  // hidden - c_local, not offset + c_local: an absurd offset must not overflow.
  if (v.ok() && (gt.gg.offset < 0 || gt.gg.offset > g.hidden - g.c_local))
    v.fail("offset", std::to_string(gt.gg.offset) + " + " + std::to_string(g.c_local) +
                         " local channels exceeds " + std::to_string(g.hidden));
  if (g.slots_overflow)
    v.fail("group_size", std::to_string(g.rows) + " rows x " + std::to_string(g.groups) +
                             " groups overflows int64");
}

void validate_weight(Validator& v, const char* name, const TensorView& w, const Gating& gt) {
  v.optional(name, w, gt.g.c_local, gt.param);
  v.params(name, gt.param, gt.x);
}

void agree_gating(PackedCall& call, const Gating& gt) {
  call.agree("rows", static_cast<double>(gt.g.rows));
  call.agree("hidden", static_cast<double>(gt.g.hidden));
  call.agree("group_size", static_cast<double>(gt.g.group_size));
  call.agree("norm_before_gate", gt.gg.norm_before_gate ? 1 : 0);
  call.agree("dtype", static_cast<double>(gt.x.dtype));
  call.agree("stats", static_cast<double>(gt.opt.stats));
  call.agree("z", gt.z.present() ? 1 : 0);
  call.agree("weight", gt.weight.present() ? 1 : 0);
  call.agree("param dtype", static_cast<double>(gt.param));
}

// One value per (row, group), or Stats::kExact's limbs of it; the local count is this rank's
// channels, which summed over the ranks must be all channels, and the slice table says where
// they are (the slices tile [0, hidden)).
PayloadSize gating_payload(const Gating& gt, bool forward) {
  const int per = gt.opt.stats == Stats::kExact ? kc::exact_row_limbs(false, forward) : 1;
  PayloadSize p{static_cast<size_t>(gt.g.slots * per), static_cast<double>(gt.g.c_local)};
  p.slice = {"channel", gt.gg.offset, gt.g.c_local, gt.g.hidden};
  return p;
}

// After the reduce: the ranks' channel slices must tile [0, hidden); returns the channels per
// group, checked against the naive mode's limit.
double checked_count(const PackedCall& call, const Gating& gt, const char* op) {
  if (call.global_count() != static_cast<double>(gt.g.hidden))
    throw Error(ErrorCode::kInvalidArgument,
                std::string("tpnorm: ") + op + ": the ranks' channel slices hold " +
                    std::to_string(static_cast<int64_t>(call.global_count())) +
                    " channels in all, expected " + std::to_string(gt.g.hidden));
  const auto n = static_cast<double>(gt.g.group_size);
  check_naive_count(gt.opt.stats, n, op, "group");
  return n;
}

// Stats::kExact: the summed limbs of every slot become its final statistic, rounded once
// (exact_row_finish on rows * groups RMS "rows" of group_size values).
std::vector<double> exact_finish(const Gating& gt, bool forward, PackedCall& call, double n) {
  std::vector<double> out(static_cast<size_t>(gt.g.slots));
  kc::RowNormArgs ra;
  ra.rows = gt.g.slots;
  ra.centered = false;
  ra.threads = gt.opt.num_threads;
  kc::exact_row_finish(ra, forward, call.payload<int64_t>(), n, out.data());
  return out;
}

// fn(T{}, P{}, W{}, S{}): storage, parameter, wire and saved-statistics types of a kernel call.
// Stats::kExact's integer wire is dispatched as double (its finished statistics).
template <class Fn>
void dispatch_gated(const Gating& gt, DType wire, DType saved, Fn&& fn) {
  const DType w = wire == DType::I64 ? DType::F64 : wire;
  dispatch_kernel_types(gt.x.dtype, w, saved, [&](auto t, auto wt, auto s) {
    using T = decltype(t);
    dispatch_params<T>(gt.param, [&](auto p) { fn(t, p, wt, s); });
  });
}

#ifdef TPNORM_WITH_CUDA
void forward_partial_device(PackedCall& call, DeviceCommunicator& dev, const GatedForward& a) {
  gated_forward_partial_cuda(call, dev, a.gt.k, a.gt.x, a.gt.z);
}
void forward_apply_device(PackedCall& call, DeviceCommunicator& dev, const GatedForward& a) {
  const Gating& gt = a.gt;
  gated_forward_apply_cuda(call, dev, gt.k, gt.g.hidden, gt.x, gt.z, gt.weight, a.y, a.rstd,
                           gt.opt);
}
void backward_partial_device(PackedCall& call, DeviceCommunicator& dev, const GatedBackward& a) {
  const Gating& gt = a.gt;
  gated_backward_partial_cuda(call, dev, gt.k, a.dy, gt.x, gt.z, gt.weight, a.rstd, a.dweight);
}
void backward_apply_device(PackedCall& call, DeviceCommunicator& dev, const GatedBackward& a) {
  const Gating& gt = a.gt;
  gated_backward_apply_cuda(call, dev, gt.k, gt.g.hidden, a.dy, gt.x, gt.z, gt.weight, a.rstd, a.dx,
                            a.dz, a.dweight);
}
PayloadSize device_payload(const Gating& gt, bool forward) {
  PayloadSize p = gating_payload(gt, forward);
  p.device_scratch = gated_scratch_cuda(gt.k);
  return p;
}
#else
PayloadSize device_payload(const Gating& gt, bool forward) { return gating_payload(gt, forward); }
#endif
// Stats::kExact stays on the CPU kernels so far: run_op refuses it on a device communicator
// (hooks not declared exact), and the validator refuses float32 weights next to fp16/bf16 x.
constexpr DeviceHooks<GatedForward> kForwardDevice =
    TPNORM_DEVICE_HOOKS(forward_partial_device, forward_apply_device);
constexpr DeviceHooks<GatedBackward> kBackwardDevice =
    TPNORM_DEVICE_HOOKS(backward_partial_device, backward_apply_device);

class GatedForwardOp final : public SpecOf<GatedForward> {
 public:
  using SpecOf::SpecOf;

  void validate(Validator& v) const override {
    const Gating& gt = args_.gt;
    v.eps(gt.opt.eps);
    validate_gating(v, gt);
    v.like("y", args_.y, gt.x);
    validate_weight(v, "weight", gt.weight, gt);
    v.optional_stats("rstd", args_.rstd, gt.g.slots, saved_dtype({}, args_.rstd));
  }
  void agree(PackedCall& call) const override {
    call.agree("eps", args_.gt.opt.eps);
    agree_gating(call, args_.gt);
  }
  PayloadSize payload() const override { return device_payload(args_.gt, true); }
  void partial(PackedCall& call) override {
    const Gating& gt = args_.gt;
    dispatch_forward_partial(
        gt.x, call.wire(), call.payload_data(),
        [&](const auto* x, int64_t* limbs) {
          kc::gated_exact_partial_forward(gt.k, x, z_as(x), limbs);
        },
        [&](const auto* x, auto* sums) { kc::gated_partial_forward(gt.k, x, z_as(x), sums); });
  }
  void apply(PackedCall& call) override {
    const Gating& gt = args_.gt;
    const double n = checked_count(call, gt, name());
    kc::GatedArgs k = gt.k;
    std::vector<double> exact;
    if (call.wire() == DType::I64) {
      exact = exact_finish(gt, true, call, n);
      k.final_stats = true;
    }
    dispatch_gated(gt, call.wire(), saved_dtype({}, args_.rstd),
                   [&](auto t, auto p, auto w, auto s) {
                     using T = decltype(t);
                     using P = decltype(p);
                     using W = decltype(w);
                     using S = decltype(s);
                     const W* stats = call.payload<W>();
                     if constexpr (std::is_same_v<W, double>)
                       if (!exact.empty()) stats = exact.data();
                     kc::gated_apply_forward<T, P, W, S>(
                         k, static_cast<const T*>(gt.x.data), static_cast<const T*>(gt.z.data),
                         static_cast<const P*>(gt.weight.data), stats, n, gt.opt.eps,
                         static_cast<T*>(args_.y.data), static_cast<S*>(args_.rstd.data));
                   });
  }

 private:
  template <class T>
  const T* z_as(const T*) const {
    return static_cast<const T*>(args_.gt.z.data);
  }
};

class GatedBackwardOp final : public SpecOf<GatedBackward> {
 public:
  using SpecOf::SpecOf;

  void validate(Validator& v) const override {
    const Gating& gt = args_.gt;
    validate_gating(v, gt);
    v.like("dy", args_.dy, gt.x);
    v.like("dx", args_.dx, gt.x);
    if (gt.z.present())
      v.like("dz", args_.dz, gt.x);
    else if (args_.dz.present())
      v.fail("dz", "is present but the gate z is absent");
    validate_weight(v, "weight", gt.weight, gt);
    validate_weight(v, "dweight", args_.dweight, gt);
    v.stats("rstd", args_.rstd, gt.g.slots);
  }
  void agree(PackedCall& call) const override { agree_gating(call, args_.gt); }
  PayloadSize payload() const override { return device_payload(args_.gt, false); }
  // This rank's dweight sums stay local (they are per local channel); written by the apply.
  void partial(PackedCall& call) override {
    const Gating& gt = args_.gt;
    dw_.assign(static_cast<size_t>(gt.g.c_local), 0.0);
    double* dw = args_.dweight.present() ? dw_.data() : nullptr;
    dispatch_gated(gt, call.wire(), args_.rstd.dtype, [&](auto t, auto p, auto w, auto s) {
      using T = decltype(t);
      using P = decltype(p);
      using S = decltype(s);
      const auto in = typed<T, P, S>();
      if (call.wire() == DType::I64) {
        if constexpr (has_exact_kernels<T>)
          kc::gated_exact_partial_backward(gt.k, in.dy, in.x, in.z, in.w, in.rstd,
                                           call.payload<int64_t>(), dw);
      } else {
        kc::gated_partial_backward(gt.k, in.dy, in.x, in.z, in.w, in.rstd,
                                   call.payload<decltype(w)>(), dw);
      }
    });
  }
  void apply(PackedCall& call) override {
    const Gating& gt = args_.gt;
    const double n = checked_count(call, gt, name());
    kc::GatedArgs k = gt.k;
    std::vector<double> exact;
    if (call.wire() == DType::I64) {
      exact = exact_finish(gt, false, call, n);
      k.final_stats = true;
    }
    dispatch_gated(gt, call.wire(), args_.rstd.dtype, [&](auto t, auto p, auto w, auto s) {
      using T = decltype(t);
      using P = decltype(p);
      using W = decltype(w);
      using S = decltype(s);
      const auto in = typed<T, P, S>();
      const W* stats = call.payload<W>();
      if constexpr (std::is_same_v<W, double>)
        if (!exact.empty()) stats = exact.data();
      kc::gated_apply_backward<T, P, W, S>(
          k, in.dy, in.x, in.z, in.w, in.rstd, stats, n, dw_.data(), static_cast<T*>(args_.dx.data),
          static_cast<T*>(args_.dz.data), static_cast<P*>(args_.dweight.data));
    });
    dw_ = {};
  }

 private:
  // The backward's inputs, typed: what its partial and apply kernels both read.
  template <class T, class P, class S>
  struct In {
    const T *dy, *x, *z;
    const P* w;
    const S* rstd;
  };
  template <class T, class P, class S>
  In<T, P, S> typed() const {
    const GatedBackward& a = args_;
    return {static_cast<const T*>(a.dy.data), static_cast<const T*>(a.gt.x.data),
            static_cast<const T*>(a.gt.z.data), static_cast<const P*>(a.gt.weight.data),
            static_cast<const S*>(a.rstd.data)};
  }

  std::vector<double> dw_;
};

}  // namespace
}  // namespace detail

PendingCall rms_norm_gated_forward_start(Communicator& comm, const TensorView& x,
                                         const TensorView& z, const GatedGroups& gg,
                                         const TensorView& weight, const TensorView& y,
                                         const TensorView& rstd, const NormOptions& opt) {
  const DType param = detail::param_dtype(x, {&weight});
  return detail::start_op(comm, std::make_unique<detail::GatedForwardOp>(
                                    "rms_norm_gated_forward", opt,
                                    detail::GatedForward{{x, z, gg, weight, opt, param}, y, rstd},
                                    detail::kForwardDevice));
}

void rms_norm_gated_forward(Communicator& comm, const TensorView& x, const TensorView& z,
                            const GatedGroups& gg, const TensorView& weight, const TensorView& y,
                            const TensorView& rstd, const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  rms_norm_gated_forward_start(comm, x, z, gg, weight, y, rstd, opt).finish();
}

PendingCall rms_norm_gated_backward_start(Communicator& comm, const TensorView& dy,
                                          const TensorView& x, const TensorView& z,
                                          const GatedGroups& gg, const TensorView& weight,
                                          const TensorView& rstd, const TensorView& dx,
                                          const TensorView& dz, const TensorView& dweight,
                                          const NormOptions& opt) {
  const DType param = detail::param_dtype(x, {&weight, &dweight});
  return detail::start_op(
      comm, std::make_unique<detail::GatedBackwardOp>(
                "rms_norm_gated_backward", opt,
                detail::GatedBackward{{x, z, gg, weight, opt, param}, dy, rstd, dx, dz, dweight},
                detail::kBackwardDevice));
}

void rms_norm_gated_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                             const TensorView& z, const GatedGroups& gg, const TensorView& weight,
                             const TensorView& rstd, const TensorView& dx, const TensorView& dz,
                             const TensorView& dweight, const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  rms_norm_gated_backward_start(comm, dy, x, z, gg, weight, rstd, dx, dz, dweight, opt).finish();
}

}  // namespace tpnorm
