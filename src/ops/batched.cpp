// batched.cpp — K row norms, one collective: the spec validates all items, writes each item's
// partial into its slice of one payload, and after the ONE reduce applies each item with its
// own global column count.
//
// Payload: [K column counts][item 0 stats][item 1 stats]... Every rank computes the same
// offsets from (rows_i, centered_i), which the agreement fingerprint covers.
#include "tpnorm/batched.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/dispatch.h"
#include "ops/op_spec.h"
#include "ops/row_stages.h"
#ifdef TPNORM_WITH_CUDA
#include "kernels/cuda/call_header.h"
#include "ops/cuda/device_call.h"
#include "ops/cuda/row_norm_cuda.h"
#endif

namespace tpnorm {
namespace detail {
namespace {

// The stages of one item: forward (RowNormItem) or backward (RowNormGradItem).
struct ForwardStages {
  static constexpr bool kForward = true;
  using Args = RowForward;
  static Args args(const RowNormItem& it) {
    return {it.centered, it.x, it.gamma, it.beta, it.y, it.mean, it.rstd};
  }
  static void validate(Validator& v, const std::string& p, const Args& a) {
    validate_row_forward(v, p, a);
  }
  static void partial(const Args& a, DType wire, void* s, const NormOptions& opt) {
    row_forward_partial(a, wire, s, {opt.num_threads});
  }
  static void apply(const Args& a, DType wire, void* s, double n, const NormOptions& opt) {
    row_forward_apply(a, wire, s, n, opt.eps, {opt.num_threads});
  }
#ifdef TPNORM_WITH_CUDA
  static size_t scratch_device(const Args&, Stats) { return 0; }
  static void partial_device(DeviceCommunicator& dev, const Args& a, bool w64, void* s, void*,
                             const NormOptions& opt) {
    row_forward_partial_at(dev, a, opt.stats, w64, s);
  }
  static void apply_device(DeviceCommunicator& dev, const Args& a, const kernels::cuda::Header& hd,
                           void*, const NormOptions& opt) {
    row_forward_apply_at(dev, a, opt.eps, hd);
  }
#endif
};

struct BackwardStages {
  static constexpr bool kForward = false;
  using Args = RowBackward;
  static Args args(const RowNormGradItem& it) {
    return {it.centered, it.dy, it.x, it.gamma, it.mean, it.rstd, it.dx, it.dgamma, it.dbeta};
  }
  static void validate(Validator& v, const std::string& p, const Args& a) {
    validate_row_backward(v, p, a);
  }
  static void partial(const Args& a, DType wire, void* s, const NormOptions& opt) {
    row_backward_partial(a, wire, s, {opt.num_threads});
  }
  static void apply(const Args& a, DType wire, void* s, double n, const NormOptions& opt) {
    row_backward_apply(a, wire, s, n, {opt.num_threads});
  }
#ifdef TPNORM_WITH_CUDA
  static size_t scratch_device(const Args& a, Stats stats) {
    return row_backward_scratch_at(a, stats);
  }
  static void partial_device(DeviceCommunicator& dev, const Args& a, bool w64, void* s,
                             void* scratch, const NormOptions& opt) {
    row_backward_partial_at(dev, a, opt.stats, w64, s, scratch);
  }
  static void apply_device(DeviceCommunicator& dev, const Args& a, const kernels::cuda::Header& hd,
                           void* scratch, const NormOptions&) {
    row_backward_apply_at(dev, a, hd, scratch);
  }
#endif
};

template <class Item, class Stages>
class BatchedOp final : public OpSpec {
 public:
  BatchedOp(const char* name, const Item* items, size_t count, const NormOptions& opt)
      : OpSpec(name, opt.stats, opt.check_agreement), items_(items), count_(count), opt_(opt) {
    if (!items) return;
    args_.reserve(count);
    offsets_.reserve(count);
    total_ = count;  // the K column counts come first
    for (size_t i = 0; i < count; ++i) {
      args_.push_back(Stages::args(items[i]));
      hidden_.push_back(items[i].hidden_size);
      offsets_.push_back(total_);
      total_ += args_.back().stat_values(opt.stats);
#ifdef TPNORM_WITH_CUDA
      scratch_at_.push_back(scratch_);
      scratch_ += (Stages::scratch_device(args_.back(), opt.stats) + 255) / 256 * 256;
#endif
    }
  }

  void validate(Validator& v) const override {
    if (count_ > 0 && !items_) v.fail("items", "is null but count is " + std::to_string(count_));
    if (Stages::kForward) v.eps(opt_.eps);
    for (size_t i = 0; i < args_.size(); ++i)
      Stages::validate(v, "items[" + std::to_string(i) + "].", args_[i]);
  }
  // PackedCall keeps a bounded number of named fields, so the items are folded into one exact
  // integer (52 bits of an FNV-1a digest fit a double).
  void agree(PackedCall& call) const override {
    uint64_t digest = call_header::kFnvOffset;
    int64_t rows_total = 0;
    for (const auto& a : args_) {
      rows_total += a.g.rows;
      const size_t i = static_cast<size_t>(&a - args_.data());
      const int64_t fields[] = {a.g.rows, a.centered, static_cast<int64_t>(a.x.dtype),
                                a.gamma.present(), hidden_[i]};
      digest = fnv1a(digest, fields, sizeof fields);
    }
    call.agree("items", static_cast<double>(items_ ? count_ : 0));
    call.agree("rows_total", static_cast<double>(rows_total));
    call.agree("item_digest", static_cast<double>(digest & ((1ULL << 52) - 1)));
    call.agree("stats", static_cast<double>(opt_.stats));
    if (Stages::kForward) call.agree("eps", opt_.eps);
  }
  PayloadSize payload() const override {
    PayloadSize p{total_, 0};
#ifdef TPNORM_WITH_CUDA
    p.device_scratch = scratch_;
#endif
    return p;
  }

  void partial(PackedCall& call) override {
    for (size_t i = 0; i < args_.size(); ++i) {
      const double cols = static_cast<double>(args_[i].g.h);
      if (call.wire() == DType::I64)  // Stats::kExact
        call.payload<int64_t>()[i] = args_[i].g.h;
      else
        dispatch_acc(call.wire(), [&](auto w) {
          call.payload<decltype(w)>()[i] = static_cast<decltype(w)>(cols);
        });
      Stages::partial(args_[i], call.wire(), at(call, offsets_[i]), opt_);
    }
  }
  // Every item's summed count is checked before any item is written: a failed call leaves
  // every output untouched.
  void apply(PackedCall& call) override {
    std::vector<double> n(args_.size());
    for (size_t i = 0; i < args_.size(); ++i) {
      if (call.wire() == DType::I64)
        n[i] = static_cast<double>(call.payload<int64_t>()[i]);
      else
        dispatch_acc(call.wire(), [&](auto w) { n[i] = call.payload<decltype(w)>()[i]; });
      check_naive_count(opt_.stats, n[i], name(), "row");
      if (hidden_[i] > 0 && n[i] != static_cast<double>(hidden_[i]))
        throw Error(ErrorCode::kInvalidArgument,
                    std::string("tpnorm: ") + name() + ": items[" + std::to_string(i) +
                        "]: the ranks' slices of the hidden dimension add up to " +
                        std::to_string(static_cast<int64_t>(n[i])) +
                        " elements per row, but its hidden size is " +
                        std::to_string(hidden_[i]));
    }
    for (size_t i = 0; i < args_.size(); ++i)
      Stages::apply(args_[i], call.wire(), at(call, offsets_[i]), n[i], opt_);
  }

#ifdef TPNORM_WITH_CUDA
  // On device: the same payload; each item's apply kernels read its own count slot and
  // statistics slice (Header::count_at / payload_at) and reject a count other than its hidden
  // size (Header::count_want); its partial and apply kernels share its own slice of the scratch.
  bool has_device_kernels() const override { return true; }
  bool has_device_exact() const override { return true; }
  void partial_device(PackedCall& call, DeviceCommunicator& dev) override {
    const bool w64 = call.wire() == DType::F64;
    std::vector<double> cols(args_.size());
    for (size_t i = 0; i < args_.size(); ++i) cols[i] = static_cast<double>(args_[i].g.h);
    {
      DeviceGuard guard(dev.device_index());
      kernels::cuda::write_values(call.payload_data(), device_wire(call.wire()), cols.data(),
                                  static_cast<int64_t>(cols.size()), dev.stream());
    }
    char* scratch = static_cast<char*>(call.scratch());
    for (size_t i = 0; i < args_.size(); ++i)
      Stages::partial_device(dev, args_[i], w64, at(call, offsets_[i]),
                             scratch ? scratch + scratch_at_[i] : nullptr, opt_);
  }
  void apply_device(PackedCall& call, DeviceCommunicator& dev) override {
    const kernels::cuda::Header whole = device_header(call, dev);
    char* scratch = static_cast<char*>(call.scratch());
    for (size_t i = 0; i < args_.size(); ++i) {
      kernels::cuda::Header hd = whole;
      hd.count_at = static_cast<int>(call.header_values() + i);
      hd.count_want = hidden_[i] > 0 ? static_cast<double>(hidden_[i]) : -1;
      hd.payload_at = static_cast<int64_t>(call.header_values() + offsets_[i]);
      Stages::apply_device(dev, args_[i], hd, scratch ? scratch + scratch_at_[i] : nullptr, opt_);
    }
  }
#endif

 private:
  static void* at(PackedCall& call, size_t value) {
    return static_cast<char*>(call.payload_data()) + value * dtype_size(call.wire());
  }

  const Item* items_;
  size_t count_;
  NormOptions opt_;
  std::vector<typename Stages::Args> args_;
  std::vector<int64_t> hidden_;  // each item's hidden size (0: not checked)
  std::vector<size_t> offsets_;  // of each item's statistics, in payload values
  size_t total_ = 0;
#ifdef TPNORM_WITH_CUDA
  std::vector<size_t> scratch_at_;  // of each item's device scratch, in bytes
  size_t scratch_ = 0;
#endif
};

}  // namespace
}  // namespace detail

PendingCall batched_norm_forward_start(Communicator& comm, const RowNormItem* items, size_t count,
                                       const NormOptions& opt) {
  return detail::start_op(comm,
                          std::make_unique<detail::BatchedOp<RowNormItem, detail::ForwardStages>>(
                              "batched_norm_forward", items, count, opt));
}

void batched_norm_forward(Communicator& comm, const RowNormItem* items, size_t count,
                          const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  batched_norm_forward_start(comm, items, count, opt).finish();
}

PendingCall batched_norm_backward_start(Communicator& comm, const RowNormGradItem* items,
                                        size_t count, const NormOptions& opt) {
  return detail::start_op(
      comm, std::make_unique<detail::BatchedOp<RowNormGradItem, detail::BackwardStages>>(
                "batched_norm_backward", items, count, opt));
}

void batched_norm_backward(Communicator& comm, const RowNormGradItem* items, size_t count,
                           const NormOptions& opt) {
  const detail::BlockingCall blocking;  // its wait follows at once
  batched_norm_backward_start(comm, items, count, opt).finish();
}

}  // namespace tpnorm
