// fused.cpp — the fused residual add + row norm specs (see tpnorm/fused.h), and the DeepNorm
// presets. forward: partial = residual add writing h and its row statistics -> ONE reduce ->
// the row norm's apply on h; backward: the row norm's stages on (dy, h) + residual epilogue.
#include "tpnorm/fused.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/dispatch.h"
#include "kernels/cpu/residual.h"
#include "ops/device_hooks.h"
#include "ops/op_spec.h"
#include "ops/row_stages.h"

namespace tpnorm {
namespace detail {
namespace {

namespace kc = kernels::cpu;

// One fused call: the residual add's own views, and the row norm's call on h.
struct FusedForward {
  TensorView x, f;
  double alpha;
  RowForwardCall norm;  // on h: norm.a.x is h
  RowGeometry gx = row_geometry(x);
};
struct FusedBackward {
  TensorView dh_extra, dx;
  double alpha;
  RowBackwardCall norm;  // on (dy, h), its input gradient into df: norm.a.x is h, norm.a.dx df
};

// Device hooks: the residual add, then the row norm's device stages on h; backward, the row
// norm's stages, then the residual epilogue (ops/cuda).
#ifdef TPNORM_WITH_CUDA
void forward_partial_device(PackedCall& call, DeviceCommunicator& dev, const FusedForward& a) {
  residual_add_cuda(dev, a.x, a.f, a.alpha, a.norm.a.x);
  row_forward_partial_cuda(call, dev, a.norm);
}
void forward_apply_device(PackedCall& call, DeviceCommunicator& dev, const FusedForward& a) {
  row_forward_apply_cuda(call, dev, a.norm);
}
void backward_partial_device(PackedCall& call, DeviceCommunicator& dev, const FusedBackward& a) {
  row_backward_partial_cuda(call, dev, a.norm);
}
void backward_apply_device(PackedCall& call, DeviceCommunicator& dev, const FusedBackward& a) {
  row_backward_apply_cuda(call, dev, a.norm);
  residual_epilogue_cuda(call, dev, a.dh_extra, a.alpha, a.norm.a.dx, a.dx, a.norm.opt);
}
#endif
constexpr DeviceHooks<FusedForward> kForwardDevice =
    TPNORM_DEVICE_HOOKS_EXACT(forward_partial_device, forward_apply_device);
constexpr DeviceHooks<FusedBackward> kBackwardDevice =
    TPNORM_DEVICE_HOOKS_EXACT(backward_partial_device, backward_apply_device);

void agree_common(PackedCall& call, const TensorView& x, int64_t rows, bool centered, double alpha,
                  const TensorView& gamma, const NormOptions& opt) {
  call.agree("rows", static_cast<double>(rows));
  call.agree("dtype", static_cast<double>(x.dtype));
  call.agree("centered", centered ? 1 : 0);
  call.agree("stats", static_cast<double>(opt.stats));
  call.agree("hidden size", static_cast<double>(opt.hidden_size));
  call.agree("alpha", alpha);
  call.agree("gamma", gamma.present() ? 1 : 0);
}

// alpha, then the first input of the residual add (x forward, h backward) under its own name.
void check_residual(Validator& v, double alpha, const char* name, const TensorView& t) {
  if (!std::isfinite(alpha)) v.fail("alpha", "must be finite");
  v.usable(name, t);
  v.storage(name, t);
}

// Forward: the partial writes h = alpha*x + f and its row statistics in one pass; the apply is
// the row norm's on h.
class FusedForwardOp final : public SpecOf<FusedForward> {
 public:
  using SpecOf::SpecOf;

  // The norm's stages see h as their input: x, f and h are checked under their own names first.
  void validate(Validator& v) const override {
    const FusedForward& a = args_;
    v.eps(a.norm.opt.eps);
    check_residual(v, a.alpha, "x", a.x);
    v.like("f", a.f, a.x);
    v.like("h", a.norm.a.x, a.x);
    validate_row_forward(v, "", a.norm.a);
  }
  void agree(PackedCall& call) const override {
    const RowForward& n = args_.norm.a;
    agree_common(call, args_.x, args_.gx.rows, n.centered, args_.alpha, n.gamma, args_.norm.opt);
    call.agree("eps", args_.norm.opt.eps);
    call.agree("beta", n.centered && n.beta.present() ? 1 : 0);
  }
  // Sized from x, whose rows the ranks agree on, so that a bad h on one rank cannot change the
  // length of its collective.
  PayloadSize payload() const override {
    const RowGeometry& g = args_.gx;
    return {static_cast<size_t>(g.rows *
                                row_stat_width(args_.norm.a.centered, args_.norm.opt.stats, true)),
            static_cast<double>(g.h)};
  }
  void partial(PackedCall& call) override { partial_rows(call, {0, args_.gx.rows}); }
  void apply(PackedCall& call) override {
    const RowForwardCall& n = args_.norm;
    check_row_count(n.opt, call.global_count(), name());
    row_forward_apply(n.a, call.wire(), call.payload_data(), call.global_count(), n.opt.eps, n.run);
  }

  // Row chunks (ops/chunking.h): h and its statistics for rows [begin, end), then their apply.
  bool chunkable(bool on_device) const override { return !on_device; }
  ChunkInfo chunk_info() const override {
    const auto reread = static_cast<int64_t>(dtype_size(args_.x.dtype));
    return {args_.gx.rows, width(), reread, args_.gx.rows * args_.gx.h * reread};
  }
  void partial_rows(PackedCall& call, const ChunkRows& c) override {
    const FusedForward& a = args_;
    const int64_t rows = c.end - c.begin, h = a.gx.h;
    const kc::RowNormArgs k{rows, h, a.norm.a.centered, a.norm.run.threads};
    const size_t at = static_cast<size_t>(c.begin * h);
    void* stats = static_cast<char*>(call.payload_data()) +
                  static_cast<size_t>(c.begin * width()) * dtype_size(call.wire());
    // Stats::kExact: h through the same residual kernel (its float64 sums to scratch), then
    // the exact row partial on h.
    const bool exact = call.wire() == DType::I64;
    std::vector<double> scratch(exact ? static_cast<size_t>(2 * rows) : 0);
    dispatch_storage(a.x.dtype, [&](auto t) {
      dispatch_acc(exact ? DType::F64 : call.wire(), [&](auto w) {
        using T = decltype(t);
        using W = decltype(w);
        kc::residual_partial_forward<T, W>(
            k, static_cast<const T*>(a.x.data) + at, static_cast<const T*>(a.f.data) + at,
            static_cast<float>(a.alpha), static_cast<T*>(a.norm.a.x.data) + at,
            exact ? reinterpret_cast<W*>(scratch.data()) : static_cast<W*>(stats));
      });
    });
    if (exact)
      row_forward_partial(rows_of(a.norm.a, c.begin, c.end), call.wire(), stats, a.norm.run);
  }
  void apply_rows(PackedCall& call, const ChunkRows& c) override {
    const RowForwardCall& n = args_.norm;
    if (c.first) check_row_count(n.opt, call.global_count(), name());
    RowRun run = n.run;
    run.row0 = c.begin;
    run.call_rows = args_.gx.rows;
    row_forward_apply(rows_of(n.a, c.begin, c.end), call.wire(),
                      static_cast<char*>(call.payload_data()) +
                          static_cast<size_t>(c.begin * width()) * dtype_size(call.wire()),
                      call.global_count(), n.opt.eps, run);
  }

 private:
  int64_t width() const { return row_stat_width(args_.norm.a.centered, args_.norm.opt.stats, true); }
};

// Backward: the row norm's stages on (dy, h) with its input gradient going to df, then the
// residual epilogue finishes df and dx.
class FusedBackwardOp final : public SpecOf<FusedBackward> {
 public:
  using SpecOf::SpecOf;

  // h and df are checked under their own names first: the stage calls them x and dx.
  void validate(Validator& v) const override {
    const FusedBackward& a = args_;
    const TensorView& h = a.norm.a.x;
    check_residual(v, a.alpha, "h", h);
    v.like("df", a.norm.a.dx, h);
    validate_row_backward(v, "", a.norm.a);
    v.like("dx", a.dx, h);
    if (a.dh_extra.present()) v.like("dh_extra", a.dh_extra, h);
  }
  void agree(PackedCall& call) const override {
    const RowBackward& n = args_.norm.a;
    agree_common(call, n.x, n.g.rows, n.centered, args_.alpha, n.gamma, args_.norm.opt);
    call.agree("dh_extra", args_.dh_extra.present() ? 1 : 0);
  }
  PayloadSize payload() const override {
    const RowBackward& n = args_.norm.a;
    PayloadSize p{n.stat_values(args_.norm.opt.stats), static_cast<double>(n.g.h)};
#ifdef TPNORM_WITH_CUDA
    p.device_scratch = row_backward_scratch_cuda(args_.norm);
#endif
    return p;
  }
  void partial(PackedCall& call) override {
    const RowBackwardCall& n = args_.norm;
    row_backward_partial(n.a, call.wire(), call.payload_data(), n.run);
  }
  void apply(PackedCall& call) override {
    const RowBackwardCall& n = args_.norm;
    check_row_count(n.opt, call.global_count(), name());
    row_backward_apply(n.a, call.wire(), call.payload_data(), call.global_count(), n.run);
    epilogue(0, n.a.g.rows);
  }

  // Row chunks (ops/chunking.h): the row norm's chunk stages on (dy, h) (dgamma/dbeta
  // accumulated over the chunks, as the row norm's backward does), then the epilogue's rows.
  bool chunkable(bool on_device) const override { return !on_device; }
  ChunkInfo chunk_info() const override {
    const RowBackward& n = args_.norm.a;
    const auto reread = static_cast<int64_t>(dtype_size(n.x.dtype)) * 2;
    return {n.g.rows, width(), reread, n.g.rows * n.g.h * reread};
  }
  void partial_rows(PackedCall& call, const ChunkRows& c) override {
    const RowBackwardCall& n = args_.norm;
    row_backward_partial(rows_of(n.a, c.begin, c.end), call.wire(), stats_of(call, c), n.run);
  }
  void apply_rows(PackedCall& call, const ChunkRows& c) override {
    const RowBackwardCall& n = args_.norm;
    RowRun run = n.run;
    run.row0 = c.begin;
    run.call_rows = n.a.g.rows;
    run.param_last = c.last;
    if (c.first) {
      check_row_count(n.opt, call.global_count(), name());
      param_acc_.assign(row_backward_acc_size(n.a, call.wire(), run), 0.0);
    }
    run.param_acc = param_acc_.data();
    row_backward_apply(rows_of(n.a, c.begin, c.end), call.wire(), stats_of(call, c),
                       call.global_count(), run);
    epilogue(c.begin, c.end);
    if (c.last) param_acc_ = {};
  }

 private:
  int64_t width() const { return row_stat_width(args_.norm.a.centered, args_.norm.opt.stats, false); }
  void* stats_of(PackedCall& call, const ChunkRows& c) const {
    return static_cast<char*>(call.payload_data()) +
           static_cast<size_t>(c.begin * width()) * dtype_size(call.wire());
  }
  // dh = dnorm + dh_extra; df = dh; dx = alpha * dh, on rows [r0, r1).
  void epilogue(int64_t r0, int64_t r1) const {
    const FusedBackward& a = args_;
    const RowBackwardCall& n = a.norm;
    const int64_t h = n.a.g.h;
    const auto at = static_cast<size_t>(r0 * h);
    dispatch_storage(n.a.x.dtype, [&](auto t) {
      using T = decltype(t);
      const T* extra = static_cast<const T*>(a.dh_extra.data);
      kc::residual_backward_epilogue<T>((r1 - r0) * h, extra ? extra + at : nullptr,
                                        static_cast<float>(a.alpha),
                                        static_cast<T*>(n.a.dx.data) + at,
                                        static_cast<T*>(a.dx.data) + at, n.run.threads);
    });
  }
  std::vector<double> param_acc_;
};

PendingCall fused_forward(const char* name, Communicator& comm, const TensorView& x,
                          const TensorView& f, double alpha, const RowForward& norm,
                          const NormOptions& opt) {
  return start_op(comm, std::make_unique<FusedForwardOp>(
                            name, opt, FusedForward{x, f, alpha, {norm, opt, {opt.num_threads}}},
                            kForwardDevice));
}

PendingCall fused_backward(const char* name, Communicator& comm, const TensorView& dh_extra,
                           double alpha, const TensorView& dx, const RowBackward& norm,
                           const NormOptions& opt) {
  return start_op(comm,
                  std::make_unique<FusedBackwardOp>(
                      name, opt, FusedBackward{dh_extra, dx, alpha, {norm, opt, {opt.num_threads}}},
                      kBackwardDevice));
}

}  // namespace
}  // namespace detail

namespace {

// The layer counts of a preset as doubles, after checking the ones it uses.
void deepnorm_layers(const char* fn, DeepNormStack stack, int64_t n, int64_t m, double* nd,
                     double* md) {
  const bool uses_n =
      stack != DeepNormStack::kDecoderOnly && stack != DeepNormStack::kDecoderOfEncoderDecoder;
  const bool uses_m = stack != DeepNormStack::kEncoderOnly;
  const bool known = stack == DeepNormStack::kEncoderOnly || stack == DeepNormStack::kDecoderOnly ||
                     stack == DeepNormStack::kEncoderOfEncoderDecoder ||
                     stack == DeepNormStack::kDecoderOfEncoderDecoder;
  auto bad = [&](const std::string& what) {
    throw Error(ErrorCode::kInvalidArgument, std::string("tpnorm: ") + fn + ": " + what);
  };
  if (!known) bad("unknown stack " + std::to_string(static_cast<int>(stack)));
  if (uses_n && n < 1) bad("encoder_layers must be >= 1, got " + std::to_string(n));
  if (uses_m && m < 1) bad("decoder_layers must be >= 1, got " + std::to_string(m));
  *nd = static_cast<double>(n);
  *md = static_cast<double>(m);
}

}  // namespace

double deepnorm_alpha(DeepNormStack stack, int64_t encoder_layers, int64_t decoder_layers) {
  double n = 0, m = 0;
  deepnorm_layers("deepnorm_alpha", stack, encoder_layers, decoder_layers, &n, &m);
  switch (stack) {
    case DeepNormStack::kEncoderOnly:
      return std::pow(2.0 * n, 0.25);
    case DeepNormStack::kDecoderOnly:
      return std::pow(2.0 * m, 0.25);
    case DeepNormStack::kEncoderOfEncoderDecoder:
      return 0.81 * std::pow(std::pow(n, 4.0) * m, 1.0 / 16.0);
    case DeepNormStack::kDecoderOfEncoderDecoder:
      return std::pow(3.0 * m, 0.25);
  }
  return 0;  // unreachable: deepnorm_layers rejects other values
}

double deepnorm_beta(DeepNormStack stack, int64_t encoder_layers, int64_t decoder_layers) {
  double n = 0, m = 0;
  deepnorm_layers("deepnorm_beta", stack, encoder_layers, decoder_layers, &n, &m);
  switch (stack) {
    case DeepNormStack::kEncoderOnly:
      return std::pow(8.0 * n, -0.25);
    case DeepNormStack::kDecoderOnly:
      return std::pow(8.0 * m, -0.25);
    case DeepNormStack::kEncoderOfEncoderDecoder:
      return 0.87 * std::pow(std::pow(n, 4.0) * m, -1.0 / 16.0);
    case DeepNormStack::kDecoderOfEncoderDecoder:
      return std::pow(12.0 * m, -0.25);
  }
  return 0;  // unreachable: deepnorm_layers rejects other values
}

PendingCall fused_add_layer_norm_forward_start(Communicator& comm, const TensorView& x,
                                               const TensorView& f, double alpha,
                                               const TensorView& gamma, const TensorView& beta,
                                               const TensorView& h, const TensorView& y,
                                               const TensorView& mean, const TensorView& rstd,
                                               const NormOptions& opt) {
  return detail::fused_forward("fused_add_layer_norm_forward", comm, x, f, alpha,
                               {true, h, gamma, beta, y, mean, rstd}, opt);
}

void fused_add_layer_norm_forward(Communicator& comm, const TensorView& x, const TensorView& f,
                                  double alpha, const TensorView& gamma, const TensorView& beta,
                                  const TensorView& h, const TensorView& y, const TensorView& mean,
                                  const TensorView& rstd, const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  fused_add_layer_norm_forward_start(comm, x, f, alpha, gamma, beta, h, y, mean, rstd, opt)
      .finish();
}

PendingCall fused_add_layer_norm_backward_start(Communicator& comm, const TensorView& dy,
                                                const TensorView& dh_extra, const TensorView& h,
                                                const TensorView& gamma, const TensorView& mean,
                                                const TensorView& rstd, double alpha,
                                                const TensorView& dx, const TensorView& df,
                                                const TensorView& dgamma, const TensorView& dbeta,
                                                const NormOptions& opt) {
  return detail::fused_backward("fused_add_layer_norm_backward", comm, dh_extra, alpha, dx,
                                {true, dy, h, gamma, mean, rstd, df, dgamma, dbeta}, opt);
}

void fused_add_layer_norm_backward(Communicator& comm, const TensorView& dy,
                                   const TensorView& dh_extra, const TensorView& h,
                                   const TensorView& gamma, const TensorView& mean,
                                   const TensorView& rstd, double alpha, const TensorView& dx,
                                   const TensorView& df, const TensorView& dgamma,
                                   const TensorView& dbeta, const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  fused_add_layer_norm_backward_start(comm, dy, dh_extra, h, gamma, mean, rstd, alpha, dx, df,
                                      dgamma, dbeta, opt)
      .finish();
}

PendingCall fused_add_rms_norm_forward_start(Communicator& comm, const TensorView& x,
                                             const TensorView& f, double alpha,
                                             const TensorView& gamma, const TensorView& h,
                                             const TensorView& y, const TensorView& rstd,
                                             const NormOptions& opt) {
  return detail::fused_forward("fused_add_rms_norm_forward", comm, x, f, alpha,
                               {false, h, gamma, {}, y, {}, rstd}, opt);
}

void fused_add_rms_norm_forward(Communicator& comm, const TensorView& x, const TensorView& f,
                                double alpha, const TensorView& gamma, const TensorView& h,
                                const TensorView& y, const TensorView& rstd,
                                const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  fused_add_rms_norm_forward_start(comm, x, f, alpha, gamma, h, y, rstd, opt).finish();
}

PendingCall fused_add_rms_norm_backward_start(Communicator& comm, const TensorView& dy,
                                              const TensorView& dh_extra, const TensorView& h,
                                              const TensorView& gamma, const TensorView& rstd,
                                              double alpha, const TensorView& dx,
                                              const TensorView& df, const TensorView& dgamma,
                                              const NormOptions& opt) {
  return detail::fused_backward("fused_add_rms_norm_backward", comm, dh_extra, alpha, dx,
                                {false, dy, h, gamma, {}, rstd, df, dgamma, {}}, opt);
}

void fused_add_rms_norm_backward(Communicator& comm, const TensorView& dy,
                                 const TensorView& dh_extra, const TensorView& h,
                                 const TensorView& gamma, const TensorView& rstd, double alpha,
                                 const TensorView& dx, const TensorView& df,
                                 const TensorView& dgamma, const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  fused_add_rms_norm_backward_start(comm, dy, dh_extra, h, gamma, rstd, alpha, dx, df, dgamma, opt)
      .finish();
}

}  // namespace tpnorm
