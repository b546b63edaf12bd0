// batch_norm.cpp — the SyncBatchNorm specs (see tpnorm/batch_norm.h for the semantics).
//
// Training: per-channel partials -> ONE reduce (count in the call header: an exact integer in
// the float64 wire, checked below 2^24 in the float32 naive wire) -> apply. Eval with running
// statistics is not collective (OpSpec::collective): validate -> apply, no collective at all.
// Nothing is written to an output, saved or running statistic before the call is known to
// succeed on every rank.
#include "kernels/cpu/batch_norm.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/dispatch.h"
#include "common/exact_sum.h"
#include "kernels/cpu/exact_channels.h"
#include "ops/batch_norm_stages.h"
#include "ops/device_hooks.h"
#include "ops/op_spec.h"
#include "tpnorm/batch_norm.h"

namespace tpnorm {
namespace detail {
namespace {

namespace kc = kernels::cpu;

constexpr DeviceHooks<BnForward> kForwardDevice =
    TPNORM_DEVICE_HOOKS_EXACT(bn_forward_partial_cuda, bn_forward_apply_cuda);
constexpr DeviceHooks<BnBackward> kBackwardDevice =
    TPNORM_DEVICE_HOOKS_EXACT(bn_backward_partial_cuda, bn_backward_apply_cuda);

// x: [N, C, *spatial] or [N, *spatial, C] of a storage dtype.
void check_x(Validator& v, const TensorView& x) {
  v.usable("x", x);
  v.storage("x", x);
  if (x.shape.ndim < 2) v.fail("x", "has shape " + x.shape.str() + ", expected [N, C, ...]");
}

// The layout is not agreed: each rank's payload is the same per-channel sums whichever layout
// its x has, and both layouts make the same chunks (below). So ranks may differ: a convolution
// hands an empty batch NCHW strides while the other ranks' batches are channels-last.
void agree_common(PackedCall& call, const TensorView& x, const kc::BatchNormArgs& a,
                  const BatchNormOptions& opt) {
  call.agree("channels", static_cast<double>(a.c));
  call.agree("dtype", static_cast<double>(x.dtype));
  call.agree("stats", static_cast<double>(opt.stats));
}

// Entries [begin, end) of v into t (end -1: all of v).
template <class S>
void store(const TensorView& t, const std::vector<double>& v, int64_t begin, int64_t end) {
  S* p = static_cast<S*>(t.data);
  for (int64_t i = begin; i < end; ++i) p[i] = static_cast<S>(v[i]);
}
void store_stat(const TensorView& t, const std::vector<double>& v, int64_t begin = 0,
                int64_t end = -1) {
  if (!t.present()) return;
  if (end < 0) end = static_cast<int64_t>(v.size());
  dispatch_acc(t.dtype, [&](auto s) { store<decltype(s)>(t, v, begin, end); });
}

// Channel chunks (OpSpec::partial_rows, ops/chunking.h: the rows are channels, 2 payload values
// each), float wires only (kExact's kernels take the whole call). The same bits per channel as
// the whole call. NCHW pipelines them; a channels-last rank (whose chunk would be a column
// slice of every row) takes part in the same chunk sums without pipelining: its whole partial
// in the first chunk, its whole apply after the last one. Whether a call is chunked must not
// depend on the layout, which the ranks do not agree on.
ChunkRows whole(int64_t c) { return {0, c, true, true, c}; }
kc::BatchNormArgs channels_of(kc::BatchNormArgs a, const ChunkRows& r) {
  a.c_begin = r.begin;
  a.c_end = r.end;
  return a;
}
bool chunkable_bn(Stats stats, bool on_device) { return !on_device && stats != Stats::kExact; }
// The channels a chunk's partial (first: true) or apply (first: false) covers on this rank:
// the chunk itself (NCHW), or all of them in the first / last chunk and none in the others
// (channels-last; nullopt: nothing to do in this chunk).
std::optional<ChunkRows> chunk_work(const kc::BatchNormArgs& a, const ChunkRows& r, bool first) {
  if (!a.channels_last) return r;
  if (first ? r.first : r.last) return whole(a.c);
  return std::nullopt;
}
ChunkInfo bn_chunk_info(const kc::BatchNormArgs& a, const TensorView& x, bool forward) {
  const auto reread = static_cast<int64_t>(dtype_size(x.dtype)) * (forward ? 1 : 2);
  return {a.c, 2, reread, a.n * a.inner * a.c * reread};
}

std::vector<double> load_stat(const TensorView& t, int64_t c) {
  std::vector<double> v(c);
  dispatch_acc(t.dtype, [&](auto s) {
    const auto* p = static_cast<const decltype(s)*>(t.data);
    for (int64_t i = 0; i < c; ++i) v[i] = static_cast<double>(p[i]);
  });
  return v;
}

// Payload: per channel {sum x, sum x^2} (forward) / {sum dy, sum dy*(x-mean)} (backward), or
// Stats::kExact's int64 limbs of the same sums (kernels/cpu/exact_channels.h); the count in the
// call header is N * inner of this rank.
PayloadSize bn_payload(const kc::BatchNormArgs& a, bool collective, Stats stats, bool forward) {
  PayloadSize p;
  if (collective) {
    const int per = stats == Stats::kExact ? tpnorm::exact::moment_limbs(forward) : 2;
    p.values = static_cast<size_t>(a.c * per);
    p.local_count = static_cast<double>(a.n * a.inner);
  }
#ifdef TPNORM_WITH_CUDA
  p.device_scratch = bn_scratch_cuda(a);
#endif
  return p;
}

class BnForwardOp final : public SpecOf<BnForward> {
 public:
  explicit BnForwardOp(const BnForward& f)
      : SpecOf("sync_batch_norm_forward", f.opt, f, kForwardDevice) {}

  bool collective() const override { return f_.batch_stats; }
  void validate(Validator& v) const override {
    const kc::BatchNormArgs& a = f_.a;
    check_x(v, f_.x);
    v.eps(f_.opt.eps);
    v.like("y", f_.y, f_.x);
    v.params(f_.gamma.present() ? "gamma" : "beta", f_.param, f_.x);
    v.optional("gamma", f_.gamma, a.c, f_.param);
    v.optional("beta", f_.beta, a.c, f_.param);
    if (f_.tracking) v.stats("running_mean", f_.running_mean, a.c);
    if (f_.tracking) v.stats("running_var", f_.running_var, a.c);
    if (f_.tracking) v.same_dtype("running_var", f_.running_var, f_.running_mean.dtype);
    if (f_.save_mean.present()) v.stats("save_mean", f_.save_mean, a.c);
    if (f_.save_invstd.present()) v.stats("save_invstd", f_.save_invstd, a.c);
    if (!f_.cumulative && !std::isfinite(f_.opt.momentum))
      v.fail("momentum", "must be finite or NaN (cumulative average)");
    if (f_.opt.training && f_.tracking && f_.cumulative && !f_.num_batches_tracked)
      v.fail("num_batches_tracked", "is required by momentum \"none\" (cumulative average)");
  }
  void agree(PackedCall& call) const override {
    agree_common(call, f_.x, f_.a, f_.opt);
    call.agree("eps", f_.opt.eps);
    call.agree("training", f_.opt.training ? 1 : 0);
    call.agree("momentum", f_.cumulative ? -1.0 : f_.opt.momentum);
    call.agree("running stats", f_.tracking ? 1 : 0);
    call.agree("gamma", f_.gamma.present() ? 1 : 0);
    call.agree("beta", f_.beta.present() ? 1 : 0);
    call.agree("param dtype", static_cast<double>(f_.param));
    call.agree("num_batches_tracked", f_.num_batches_tracked ? 1 : 0);
  }
  PayloadSize payload() const override {
    return bn_payload(f_.a, f_.batch_stats, f_.opt.stats, true);
  }
  // The host counter (and the cumulative momentum from it) advances only when the call is
  // accepted: on a device the host learns that from a host-side header check.
  bool needs_host_verdict() const override {
    return f_.batch_stats && f_.opt.training && f_.tracking && f_.num_batches_tracked;
  }

  void partial(PackedCall& call) override {
    if (!f_.batch_stats) return;
    fused_ = f_.fuses();
    if (fused_) return;  // the apply computes the statistics (the payload stays zero)
    dispatch_forward_partial(
        f_.x, call.wire(), call.payload_data(),
        [&](const auto* x, int64_t* limbs) { kc::bn_exact_partial_forward(f_.a, x, limbs); },
        [&](const auto* x, auto* sums) { kc::bn_partial_forward(f_.a, x, sums); });
  }
  void apply(PackedCall& call) override { apply_channels(call, whole(f_.a.c)); }

  bool chunkable(bool on_device) const override {
    return f_.batch_stats && chunkable_bn(f_.opt.stats, on_device);
  }
  ChunkInfo chunk_info() const override { return bn_chunk_info(f_.a, f_.x, true); }
  void partial_rows(PackedCall& call, const ChunkRows& chunk) override {
    const std::optional<ChunkRows> r = chunk_work(f_.a, chunk, true);
    if (!r) return;
    dispatch_forward_partial(
        f_.x, call.wire(), call.payload_data(), [](const auto*, int64_t*) {},
        [&](const auto* x, auto* sums) { kc::bn_partial_forward(channels_of(f_.a, *r), x, sums); });
  }
  void apply_rows(PackedCall& call, const ChunkRows& chunk) override {
    if (const std::optional<ChunkRows> r = chunk_work(f_.a, chunk, false)) apply_channels(call, *r);
  }

 private:
  // Channels [r.begin, r.end) of the outputs (the whole call, or a chunk); the checks of the
  // summed count in the first chunk, before anything is written.
  void apply_channels(PackedCall& call, const ChunkRows& r) {
    const int64_t c = f_.a.c;
    std::vector<double> mean(c), invstd(c), var(c);
    if (f_.batch_stats) {
      const double n = call.global_count();
      if (r.first) check_count(n);
      if (n == 0) return empty_batch(call, r);
      if (fused_) return fused_apply(call, n);
      if (call.wire() == DType::I64)
        kc::bn_exact_moments(c, call.payload<int64_t>(), n, mean.data(), var.data());
      else
        dispatch_acc(call.wire(), [&](auto w) {
          kc::bn_moments(r.end - r.begin, call.payload<decltype(w)>() + 2 * r.begin, n,
                         mean.data() + r.begin, var.data() + r.begin);
        });
      if (f_.opt.training && f_.tracking) update_running(mean, var, n, r);
    } else {
      mean = load_stat(f_.running_mean, c);
      var = load_stat(f_.running_var, c);
    }
    for (int64_t i = r.begin; i < r.end; ++i) invstd[i] = 1.0 / std::sqrt(var[i] + f_.opt.eps);
    dispatch_storage(f_.x.dtype, [&](auto t) {
      using T = decltype(t);
      dispatch_params<T>(f_.param, [&](auto p) {
        using P = decltype(p);
        kc::bn_apply_forward<T, P, double>(channels_of(f_.a, r), static_cast<const T*>(f_.x.data),
                                           static_cast<const P*>(f_.gamma.data),
                                           static_cast<const P*>(f_.beta.data), mean.data(),
                                           invstd.data(), static_cast<T*>(f_.y.data));
      });
    });
    store_stat(f_.save_mean, mean, r.begin, r.end);
    store_stat(f_.save_invstd, invstd, r.begin, r.end);
  }

  // An empty global batch (every rank's N is 0) normalises nothing, as torch's SyncBatchNorm:
  // over several ranks its statistics gather mean 0 and unbiased variance 0 / (0 - 1), so the
  // running statistics become (1 - momentum) times themselves; at one rank (torch's plain
  // batch_norm) they stay; num_batches_tracked counts the call. The saved statistics are 0 (a
  // backward then gives zero parameter gradients).
  void empty_batch(const PackedCall& call, const ChunkRows& r) {
    const std::vector<double> zero(static_cast<size_t>(f_.a.c), 0.0);
    if (f_.opt.training && f_.tracking) {
      if (call.ranks() > 1) {
        update_running(zero, zero, 0, r);
      } else if (f_.num_batches_tracked && r.last) {
        *f_.num_batches_tracked += 1;
      }
    }
    store_stat(f_.save_mean, zero, r.begin, r.end);
    store_stat(f_.save_invstd, zero, r.begin, r.end);
  }

  void check_count(double n) const {
    check_naive_count(f_.opt.stats, n, name(), "channel");
    if (n == 1)  // the same n on every rank, so every rank throws here together
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("tpnorm: ") + name() + ": expected more than 1 value per channel " +
                      "over all ranks, got " + std::to_string(static_cast<int64_t>(n)));
  }

  // One rank: statistics and outputs channel by channel (the same bits as the partial + reduce +
  // apply above), then the running and saved statistics as there.
  void fused_apply(PackedCall& call, double n) {
    const int64_t c = f_.a.c;
    std::vector<double> mean(c), var(c), invstd(c);
    dispatch_storage(f_.x.dtype, [&](auto t) {
      using T = decltype(t);
      dispatch_params<T>(f_.param, [&](auto p) {
        using P = decltype(p);
        dispatch_acc(call.wire(), [&](auto w) {
          kc::bn_fused_forward<T, P, decltype(w)>(
              f_.a, static_cast<const T*>(f_.x.data), static_cast<const P*>(f_.gamma.data),
              static_cast<const P*>(f_.beta.data), f_.opt.eps, n, mean.data(), var.data(),
              invstd.data(), static_cast<T*>(f_.y.data));
        });
      });
    });
    if (f_.opt.training && f_.tracking) update_running(mean, var, n, whole(c));
    store_stat(f_.save_mean, mean);
    store_stat(f_.save_invstd, invstd);
  }

  // Channels [r.begin, r.end) of the running statistics; num_batches_tracked counts the call
  // once, in its last chunk.
  void update_running(const std::vector<double>& mean, const std::vector<double>& var, double n,
                      const ChunkRows& r) {
    const int64_t tracked = f_.num_batches_tracked ? *f_.num_batches_tracked + 1 : 0;
    const double m = f_.cumulative ? 1.0 / static_cast<double>(tracked) : f_.opt.momentum;
    std::vector<double> rm = load_stat(f_.running_mean, f_.a.c);
    std::vector<double> rv = load_stat(f_.running_var, f_.a.c);
    for (int64_t c = r.begin; c < r.end; ++c) {
      rm[c] = (1 - m) * rm[c] + m * mean[c];
      rv[c] = (1 - m) * rv[c] + m * var[c] * n / (n - 1);  // unbiased, as PyTorch
    }
    store_stat(f_.running_mean, rm, r.begin, r.end);
    store_stat(f_.running_var, rv, r.begin, r.end);
    if (f_.num_batches_tracked && r.last) *f_.num_batches_tracked = tracked;
  }

  const BnForward& f_ = args_;
  bool fused_ = false;
};

class BnBackwardOp final : public SpecOf<BnBackward> {
 public:
  explicit BnBackwardOp(const BnBackward& b)
      : SpecOf("sync_batch_norm_backward", b.opt, b, kBackwardDevice) {}

  bool collective() const override { return b_.opt.training; }
  void validate(Validator& v) const override {
    const int64_t c = b_.a.c;
    check_x(v, b_.x);
    v.like("dy", b_.dy, b_.x);
    v.like("dx", b_.dx, b_.x);
    v.params(b_.gamma.present()    ? "gamma"
             : b_.dgamma.present() ? "dgamma"
                                   : "dbeta",
             b_.param, b_.x);
    v.optional("gamma", b_.gamma, c, b_.param);
    v.stats("save_mean", b_.save_mean, c);
    v.stats("save_invstd", b_.save_invstd, c);
    v.same_dtype("save_invstd", b_.save_invstd, b_.save_mean.dtype);
    v.optional("dgamma", b_.dgamma, c, b_.param);
    v.optional("dbeta", b_.dbeta, c, b_.param);
  }
  void agree(PackedCall& call) const override {
    agree_common(call, b_.x, b_.a, b_.opt);
    call.agree("training", b_.opt.training ? 1 : 0);
    call.agree("gamma", b_.gamma.present() ? 1 : 0);
    call.agree("param dtype", static_cast<double>(b_.param));
  }
  // In eval too: the partial's local sums give dgamma / dbeta.
  PayloadSize payload() const override { return bn_payload(b_.a, true, b_.opt.stats, false); }

  // This rank's partials, kept for dgamma / dbeta (local sums) before the payload is summed.
  void partial(PackedCall& call) override {
    local_.assign(static_cast<size_t>(2 * b_.a.c), 0.0);
    if (call.wire() == DType::I64) return exact_partial(call);
    fused_ = b_.fuses();
    if (fused_) return;  // the apply computes the sums (the payload stays zero)
    partial_channels(call, whole(b_.a.c));
  }
  void apply(PackedCall& call) override {
    if (call.wire() == DType::I64) return exact_apply(call);
    apply_channels(call, whole(b_.a.c));
  }

  bool chunkable(bool on_device) const override {
    return b_.opt.training && chunkable_bn(b_.opt.stats, on_device);
  }
  ChunkInfo chunk_info() const override { return bn_chunk_info(b_.a, b_.x, false); }
  void partial_rows(PackedCall& call, const ChunkRows& chunk) override {
    if (chunk.first) local_.assign(static_cast<size_t>(2 * b_.a.c), 0.0);
    if (const std::optional<ChunkRows> r = chunk_work(b_.a, chunk, true)) partial_channels(call, *r);
  }
  void apply_rows(PackedCall& call, const ChunkRows& chunk) override {
    if (const std::optional<ChunkRows> r = chunk_work(b_.a, chunk, false)) apply_channels(call, *r);
  }

 private:
  void partial_channels(PackedCall& call, const ChunkRows& r) {
    dispatch(call, [&](auto t, auto w, auto s) {
      using T = decltype(t);
      using W = decltype(w);
      using S = decltype(s);
      W* p = call.payload<W>();
      kc::bn_partial_backward<T, W, S>(channels_of(b_.a, r), static_cast<const T*>(b_.dy.data),
                                       static_cast<const T*>(b_.x.data),
                                       static_cast<const S*>(b_.save_mean.data), p);
      for (int64_t i = 2 * r.begin; i < 2 * r.end; ++i) local_[i] = p[i];
    });
  }

  // dx and dgamma / dbeta of channels [r.begin, r.end) (the whole call, or a chunk).
  void apply_channels(PackedCall& call, const ChunkRows& r) {
    double n = 0;
    if (b_.opt.training) {
      n = call.global_count();
      if (r.first) check_naive_count(b_.opt.stats, n, name(), "channel");
    }
    if (fused_) return fused_apply(call, n);
    if (!b_.opt.training) {
      // Eval: mean and invstd are constants, so dx = gamma*invstd*dy (zero global sums).
      dispatch(call, [&](auto, auto w, auto) {
        std::fill_n(call.payload<decltype(w)>(), 2 * b_.a.c, decltype(w)(0));
      });
    }
    dispatch(call, [&](auto t, auto w, auto s) {
      using T = decltype(t);
      using W = decltype(w);
      using S = decltype(s);
      dispatch_params<T>(b_.param, [&](auto p) {
        using P = decltype(p);
        kc::bn_apply_backward<T, P, W, S>(
            channels_of(b_.a, r), static_cast<const T*>(b_.dy.data),
            static_cast<const T*>(b_.x.data), static_cast<const P*>(b_.gamma.data),
            static_cast<const S*>(b_.save_mean.data), static_cast<const S*>(b_.save_invstd.data),
            call.payload<W>(), n, static_cast<T*>(b_.dx.data));
        param_grads<P, S>(r);
      });
    });
  }

  template <class Fn>
  void dispatch(PackedCall& call, Fn&& fn) {
    dispatch_kernel_types(b_.x.dtype, call.wire(), b_.save_mean.dtype, fn);
  }

  // One rank: this rank's sums and dx channel by channel (the same bits as the partial + apply),
  // the sums written to the (otherwise unused) payload and kept for dgamma / dbeta.
  void fused_apply(PackedCall& call, double n) {
    dispatch(call, [&](auto t, auto w, auto s) {
      using T = decltype(t);
      using W = decltype(w);
      using S = decltype(s);
      dispatch_params<T>(b_.param, [&](auto p) {
        using P = decltype(p);
        W* sums = call.payload<W>();
        kc::bn_fused_backward<T, P, W, S>(
            b_.a, static_cast<const T*>(b_.dy.data), static_cast<const T*>(b_.x.data),
            static_cast<const P*>(b_.gamma.data), static_cast<const S*>(b_.save_mean.data),
            static_cast<const S*>(b_.save_invstd.data), n, sums, static_cast<T*>(b_.dx.data));
        for (size_t i = 0; i < local_.size(); ++i) local_[i] = sums[i];
        param_grads<P, S>(whole(b_.a.c));
      });
    });
  }

  // Stats::kExact: the limbs of the exact sums; this rank's rounded once for dgamma / dbeta.
  void exact_partial(PackedCall& call) {
    dispatch_storage(b_.x.dtype, [&](auto t) {
      dispatch_acc(b_.save_mean.dtype, [&](auto s) {
        using T = decltype(t);
        using S = decltype(s);
        if constexpr (has_exact_kernels<T>)
          kc::bn_exact_partial_backward<T, S>(
              b_.a, static_cast<const T*>(b_.dy.data), static_cast<const T*>(b_.x.data),
              static_cast<const S*>(b_.save_mean.data), call.payload<int64_t>());
      });
    });
    kc::bn_exact_backward_sums(b_.a.c, call.payload<int64_t>(), 1.0, local_.data());
  }
  // The summed limbs come out divided by the count and rounded once, so bn_apply_backward
  // takes them with n = 1 (eval: zero sums and n = 0, dx = gamma*invstd*dy).
  void exact_apply(PackedCall& call) {
    std::vector<double> sums(static_cast<size_t>(2 * b_.a.c), 0.0);
    double n = 0;
    if (b_.opt.training) {
      check_naive_count(b_.opt.stats, call.global_count(), name(), "channel");
      kc::bn_exact_backward_sums(b_.a.c, call.payload<int64_t>(), call.global_count(), sums.data());
      n = 1;
    }
    dispatch_kernel_types(b_.x.dtype, DType::F64, b_.save_mean.dtype, [&](auto t, auto, auto s) {
      using T = decltype(t);
      using S = decltype(s);
      dispatch_params<T>(b_.param, [&](auto p) {
        using P = decltype(p);
        kc::bn_apply_backward<T, P, double, S>(
            b_.a, static_cast<const T*>(b_.dy.data), static_cast<const T*>(b_.x.data),
            static_cast<const P*>(b_.gamma.data), static_cast<const S*>(b_.save_mean.data),
            static_cast<const S*>(b_.save_invstd.data), sums.data(), n,
            static_cast<T*>(b_.dx.data));
        param_grads<P, S>(whole(b_.a.c));
      });
    });
  }

  // dgamma / dbeta of channels [r.begin, r.end) (P: the parameter type) from this rank's
  // partials.
  template <class P, class S>
  void param_grads(const ChunkRows& r) {
    auto* dg = static_cast<P*>(b_.dgamma.data);
    auto* db = static_cast<P*>(b_.dbeta.data);
    kc::bn_param_grads<P, double, S>(r.end - r.begin, local_.data() + 2 * r.begin,
                                     static_cast<const S*>(b_.save_invstd.data) + r.begin,
                                     dg ? dg + r.begin : dg, db ? db + r.begin : db);
  }

  const BnBackward& b_ = args_;
  std::vector<double> local_;
  bool fused_ = false;
};

}  // namespace
}  // namespace detail

PendingCall sync_batch_norm_forward_start(
    Communicator& comm, const TensorView& x, const TensorView& gamma, const TensorView& beta,
    const TensorView& running_mean, const TensorView& running_var, int64_t* num_batches_tracked,
    const TensorView& y, const TensorView& save_mean, const TensorView& save_invstd,
    const BatchNormOptions& opt) {
  detail::BnForward f{x, gamma,     beta,        running_mean, running_var, num_batches_tracked,
                      y, save_mean, save_invstd, opt};
  f.one_rank = comm.size() == 1;
  return detail::start_op(comm, std::make_unique<detail::BnForwardOp>(f));
}

void sync_batch_norm_forward(Communicator& comm, const TensorView& x, const TensorView& gamma,
                             const TensorView& beta, const TensorView& running_mean,
                             const TensorView& running_var, int64_t* num_batches_tracked,
                             const TensorView& y, const TensorView& save_mean,
                             const TensorView& save_invstd, const BatchNormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  sync_batch_norm_forward_start(comm, x, gamma, beta, running_mean, running_var,
                                num_batches_tracked, y, save_mean, save_invstd, opt)
      .finish();
}

PendingCall sync_batch_norm_backward_start(Communicator& comm, const TensorView& dy,
                                           const TensorView& x, const TensorView& gamma,
                                           const TensorView& save_mean,
                                           const TensorView& save_invstd, const TensorView& dx,
                                           const TensorView& dgamma, const TensorView& dbeta,
                                           const BatchNormOptions& opt) {
  detail::BnBackward b{dy, x, gamma, save_mean, save_invstd, dx, dgamma, dbeta, opt};
  b.one_rank = comm.size() == 1;
  return detail::start_op(comm, std::make_unique<detail::BnBackwardOp>(b));
}

void sync_batch_norm_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                              const TensorView& gamma, const TensorView& save_mean,
                              const TensorView& save_invstd, const TensorView& dx,
                              const TensorView& dgamma, const TensorView& dbeta,
                              const BatchNormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  sync_batch_norm_backward_start(comm, dy, x, gamma, save_mean, save_invstd, dx, dgamma, dbeta, opt)
      .finish();
}

}  // namespace tpnorm
