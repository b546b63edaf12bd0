// row_norm.cpp — the LayerNorm / RMSNorm specs (see tpnorm/norm.h for the formulas). LayerNorm
// and RMSNorm differ only in `centered`; the one runner (op_spec.h) drives both.
#include <memory>
#include <vector>

#include "ops/device_hooks.h"
#include "ops/op_spec.h"
#include "ops/row_stages.h"
#include "tpnorm/norm.h"

namespace tpnorm {
namespace detail {
namespace {

// At one rank the reduce is the identity, so the apply kernels compute each row's statistics
// themselves while the row is in cache (row_stages.h RowRun); the call still makes its one
// collective, which checks the arguments, before any output is written.
RowRun row_run(const Communicator& comm, const NormOptions& opt) {
  return {opt.num_threads, comm.size() == 1};
}

// Chunks (OpSpec::partial_rows): the payload slice of rows from c.begin, and the run of a chunk.
void* stats_at(PackedCall& call, const ChunkRows& c, int64_t width) {
  return static_cast<char*>(call.payload_data()) +
         static_cast<size_t>(c.begin * width) * dtype_size(call.wire());
}
RowRun chunk_run(RowRun run, const ChunkRows& c, int64_t rows) {
  run.row0 = c.begin;
  run.call_rows = rows;
  run.param_last = c.last;
  if (!run.fused) {  // one rank: no partial runs, nothing to prefetch for it
    run.pf_begin = c.next_begin;
    run.pf_end = c.next_end;
  }
  return run;
}
template <class Tensor>
ChunkInfo row_chunk_info(const Tensor& a, Stats stats, bool forward) {
  const auto reread = static_cast<int64_t>(dtype_size(a.x.dtype)) * (forward ? 1 : 2);
  return {a.g.rows, row_stat_width(a.centered, stats, forward), reread, a.g.rows * a.g.h * reread,
          true};
}

void agree_rows(PackedCall& call, const TensorView& x, int64_t rows, bool centered,
                const NormOptions& opt) {
  call.agree("rows", static_cast<double>(rows));
  call.agree("dtype", static_cast<double>(x.dtype));
  call.agree("centered", centered ? 1 : 0);
  call.agree("stats", static_cast<double>(opt.stats));
  call.agree("hidden size", static_cast<double>(opt.hidden_size));
}

class RowForwardOp final : public SpecOf<RowForwardCall> {
 public:
  using SpecOf::SpecOf;

  void validate(Validator& v) const override {
    v.eps(args_.opt.eps);
    validate_row_forward(v, "", args_.a);
  }
  void agree(PackedCall& call) const override {
    const RowForward& a = args_.a;
    agree_rows(call, a.x, a.g.rows, a.centered, args_.opt);
    call.agree("eps", args_.opt.eps);
    call.agree("gamma", a.gamma.present() ? 1 : 0);
    call.agree("beta", a.beta.present() ? 1 : 0);
    call.agree("param dtype", static_cast<double>(a.param));
  }
  PayloadSize payload() const override {
    return {args_.a.stat_values(args_.opt.stats), static_cast<double>(args_.a.g.h)};
  }
  void partial(PackedCall& call) override {
    if (!args_.run.fused) row_forward_partial(args_.a, call.wire(), call.payload_data(), args_.run);
  }
  void apply(PackedCall& call) override {
    check_row_count(args_.opt, call.global_count(), name());
    row_forward_apply(args_.a, call.wire(), call.payload_data(), call.global_count(), args_.opt.eps,
                      args_.run);
  }

  bool chunkable(bool on_device) const override { return !on_device || has_device_chunks(); }
  ChunkInfo chunk_info() const override { return row_chunk_info(args_.a, args_.opt.stats, true); }
  void partial_rows(PackedCall& call, const ChunkRows& c) override {
    if (!args_.run.fused)
      row_forward_partial(rows_of(args_.a, c.begin, c.end), call.wire(),
                          stats_at(call, c, width()), chunk_run(args_.run, c, args_.a.g.rows));
  }
  void apply_rows(PackedCall& call, const ChunkRows& c) override {
    if (c.first) check_row_count(args_.opt, call.global_count(), name());
    row_forward_apply(rows_of(args_.a, c.begin, c.end), call.wire(), stats_at(call, c, width()),
                      call.global_count(), args_.opt.eps, chunk_run(args_.run, c, args_.a.g.rows));
  }

 private:
  int64_t width() const { return row_stat_width(args_.a.centered, args_.opt.stats, true); }
};

class RowBackwardOp final : public SpecOf<RowBackwardCall> {
 public:
  using SpecOf::SpecOf;

  void validate(Validator& v) const override { validate_row_backward(v, "", args_.a); }
  void agree(PackedCall& call) const override {
    const RowBackward& a = args_.a;
    agree_rows(call, a.x, a.g.rows, a.centered, args_.opt);
    call.agree("gamma", a.gamma.present() ? 1 : 0);
    call.agree("param dtype", static_cast<double>(a.param));
  }
  PayloadSize payload() const override {
    PayloadSize p{args_.a.stat_values(args_.opt.stats), static_cast<double>(args_.a.g.h)};
#ifdef TPNORM_WITH_CUDA
    p.device_scratch = row_backward_scratch_cuda(args_);
#endif
    return p;
  }
  void partial(PackedCall& call) override {
    if (!args_.run.fused)
      row_backward_partial(args_.a, call.wire(), call.payload_data(),
                           params_run(call, args_.run, true, false, true));
  }
  void apply(PackedCall& call) override {
    check_row_count(args_.opt, call.global_count(), name());
    row_backward_apply(args_.a, call.wire(), call.payload_data(), call.global_count(),
                       params_run(call, args_.run, false, false, true));
    param_acc_ = {};
  }

  // Device chunks (ops/cuda/row_chunks_cuda.h): not for Stats::kExact, whose dgamma/dbeta
  // kernel adds fixed 256-row blocks counted from the call's row 0 (an agreed field, so every
  // rank decides the same).
  bool chunkable(bool on_device) const override {
    return !on_device || (has_device_chunks() && args_.opt.stats != Stats::kExact);
  }
  ChunkInfo chunk_info() const override { return row_chunk_info(args_.a, args_.opt.stats, false); }
  void partial_rows(PackedCall& call, const ChunkRows& c) override {
    if (!args_.run.fused)
      row_backward_partial(rows_of(args_.a, c.begin, c.end), call.wire(),
                           stats_at(call, c, width()),
                           params_run(call, chunk_run(args_.run, c, args_.a.g.rows), true, true,
                                      c.first));
  }
  // dgamma/dbeta: one accumulator for the call's chunks, in the order of the unchunked call
  // (row_stages.h RowRun::param_acc); written by the last chunk.
  void apply_rows(PackedCall& call, const ChunkRows& c) override {
    if (c.first) check_row_count(args_.opt, call.global_count(), name());
    const RowRun run =
        params_run(call, chunk_run(args_.run, c, args_.a.g.rows), false, true, c.first);
    row_backward_apply(rows_of(args_.a, c.begin, c.end), call.wire(), stats_at(call, c, width()),
                       call.global_count(), run);
    if (c.last) param_acc_ = {};
  }

 private:
  int64_t width() const { return row_stat_width(args_.a.centered, args_.opt.stats, false); }
  // The run of a stage with the dgamma/dbeta accumulator: summed by the partials where they
  // can (RowRun::params_in_partial: the apply only writes dx), by the applies otherwise (an
  // unchunked apply then keeps its own). The first stage of the call that sums zeroes it.
  RowRun params_run(PackedCall& call, RowRun run, bool partial, bool chunked, bool first) {
    run.params_in_partial = row_backward_params_in_partial(args_.a, call.wire(), run);
    if (!run.params_in_partial && !chunked) return run;
    if (first && partial == run.params_in_partial)
      param_acc_.assign(row_backward_acc_size(args_.a, call.wire(), run), 0.0);
    run.param_acc = param_acc_.data();
    return run;
  }
  std::vector<double> param_acc_;
};

constexpr DeviceHooks<RowForwardCall> kForwardDevice =
    TPNORM_DEVICE_CHUNK_HOOKS_EXACT(row_forward_partial_cuda, row_forward_apply_cuda,
                                    row_forward_partial_rows_cuda, row_forward_apply_rows_cuda);
constexpr DeviceHooks<RowBackwardCall> kBackwardDevice =
    TPNORM_DEVICE_CHUNK_HOOKS_EXACT(row_backward_partial_cuda, row_backward_apply_cuda,
                                    row_backward_partial_rows_cuda, row_backward_apply_rows_cuda);

PendingCall row_forward(const char* name, Communicator& comm, const RowForward& a,
                        const NormOptions& opt) {
  return start_op(comm, std::make_unique<RowForwardOp>(
                            name, opt, RowForwardCall{a, opt, row_run(comm, opt)}, kForwardDevice));
}

PendingCall row_backward(const char* name, Communicator& comm, const RowBackward& a,
                         const NormOptions& opt) {
  return start_op(
      comm, std::make_unique<RowBackwardOp>(name, opt, RowBackwardCall{a, opt, row_run(comm, opt)},
                                            kBackwardDevice));
}

}  // namespace
}  // namespace detail

PendingCall layer_norm_forward_start(Communicator& comm, const TensorView& x,
                                     const TensorView& gamma, const TensorView& beta,
                                     const TensorView& y, const TensorView& mean,
                                     const TensorView& rstd, const NormOptions& opt) {
  return detail::row_forward("layer_norm_forward", comm, {true, x, gamma, beta, y, mean, rstd},
                             opt);
}

void layer_norm_forward(Communicator& comm, const TensorView& x, const TensorView& gamma,
                        const TensorView& beta, const TensorView& y, const TensorView& mean,
                        const TensorView& rstd, const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  layer_norm_forward_start(comm, x, gamma, beta, y, mean, rstd, opt).finish();
}

PendingCall layer_norm_backward_start(Communicator& comm, const TensorView& dy, const TensorView& x,
                                      const TensorView& gamma, const TensorView& mean,
                                      const TensorView& rstd, const TensorView& dx,
                                      const TensorView& dgamma, const TensorView& dbeta,
                                      const NormOptions& opt) {
  return detail::row_backward("layer_norm_backward", comm,
                              {true, dy, x, gamma, mean, rstd, dx, dgamma, dbeta}, opt);
}

void layer_norm_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                         const TensorView& gamma, const TensorView& mean, const TensorView& rstd,
                         const TensorView& dx, const TensorView& dgamma, const TensorView& dbeta,
                         const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  layer_norm_backward_start(comm, dy, x, gamma, mean, rstd, dx, dgamma, dbeta, opt).finish();
}

PendingCall rms_norm_forward_start(Communicator& comm, const TensorView& x, const TensorView& gamma,
                                   const TensorView& y, const TensorView& rstd,
                                   const NormOptions& opt) {
  return detail::row_forward("rms_norm_forward", comm, {false, x, gamma, {}, y, {}, rstd}, opt);
}

void rms_norm_forward(Communicator& comm, const TensorView& x, const TensorView& gamma,
                      const TensorView& y, const TensorView& rstd, const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  rms_norm_forward_start(comm, x, gamma, y, rstd, opt).finish();
}

PendingCall rms_norm_backward_start(Communicator& comm, const TensorView& dy, const TensorView& x,
                                    const TensorView& gamma, const TensorView& rstd,
                                    const TensorView& dx, const TensorView& dgamma,
                                    const NormOptions& opt) {
  return detail::row_backward("rms_norm_backward", comm,
                              {false, dy, x, gamma, {}, rstd, dx, dgamma, {}}, opt);
}

void rms_norm_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                       const TensorView& gamma, const TensorView& rstd, const TensorView& dx,
                       const TensorView& dgamma, const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  rms_norm_backward_start(comm, dy, x, gamma, rstd, dx, dgamma, opt).finish();
}

}  // namespace tpnorm
