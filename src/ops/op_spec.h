// op_spec.h — the one op skeleton. Every public call of tpnorm is a small spec (an OpSpec)
// that run_op() drives through the same three phases on every backend:
//
//   validate + agree   local checks, recorded on the call instead of thrown; the fields every
//                      rank must agree on (the fingerprint of the call header)
//   partial            this rank's statistics into the payload of the ONE collective
//   reduce             PackedCall::reduce: header + payload, one all-reduce; a failed or
//                      disagreeing call throws the same tpnorm::Error on every rank here
//   apply              outputs from the summed statistics (nothing is written before)
//
// A spec holds its arguments and geometry (computed once, in its constructor) and fills the
// hooks below; the shape follows nccl-tests' `struct testColl`. On a host communicator the
// host hooks run the CPU kernels; on a device communicator (comm/device_comm.h) the device
// hooks run the CUDA kernels on the communicator's stream, and a spec without them fails on
// every rank. Adding an op = one OpSpec subclass + its kernels (see ARCHITECTURE.md).
//
// The runner's cut is the split-phase cut: start = validate, agree, prepare, partial and the
// collective; finish = wait and apply. A statistics mode is a wire dtype (wire_of): a new mode
// adds a case there and in the kernels' dispatch, not a new runner.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/nvtx.h"
#include "ops/chunking.h"
#include "ops/packed_call.h"
#include "ops/slices.h"
#include "ops/validate.h"
#include "tpnorm/communicator.h"
#include "tpnorm/norm.h"
#include "tpnorm/split.h"

namespace tpnorm::detail {

/// The wire type of a statistics mode: float64 robust, float32 naive, int64 limbs exact.
inline DType wire_of(Stats s) {
  switch (s) {
    case Stats::kNaive:
      return DType::F32;
    case Stats::kExact:
      return DType::I64;
    default:
      return DType::F64;
  }
}

/// Float32 wire counts are exact below 2^24 only, and Stats::kExact's integers have room for
/// fewer than 2^32 values a statistic: throws (on every rank together when n is a reduced
/// count) beyond that. `per` names the statistic set, e.g. "row", "channel".
void check_naive_count(Stats s, double n, const char* op, const char* per);

/// check_naive_count per row, and NormOptions::hidden_size against the reduced count `n`.
void check_row_count(const NormOptions& opt, double n, const char* op);

/// The dtype of saved statistics: rstd's, else mean's, else float32 (nothing saved).
inline DType saved_dtype(const TensorView& mean, const TensorView& rstd) {
  return rstd.present() ? rstd.dtype : (mean.present() ? mean.dtype : DType::F32);
}

/// What one call sends: the same `values` on every rank that agrees (failed or not).
struct PayloadSize {
  size_t values = 0;          ///< payload values of the wire type after the call header
  double local_count = 0;     ///< this rank's element count per statistic set (header [1])
  size_t device_scratch = 0;  ///< device calls: scratch bytes after the payload (call.scratch())
  /// A spec whose ranks hold slices of a dimension at offsets of their own (GroupNorm's
  /// channels, the gated RMSNorm's): the runner appends the slice table (ops/slices.h) to the
  /// payload and checks, after the reduce, that the slices tile the dimension. Not for
  /// chunkable specs.
  Slice slice = {};
};

/// Rows [begin, end) of a chunked call (ops/chunking.h): the runner runs partial_rows on each
/// chunk, sums each chunk's payload slice in its own collective, and runs apply_rows on each
/// chunk in order; `first` and `last` mark the call's first and last chunk; `size` is the
/// plan's rows per chunk (chunk 0's rows; the last chunk may have fewer). For apply_rows,
/// [next_begin, next_end) are the rows whose partial_rows runs next (empty: none): a host apply,
/// which computes from cache, may prefetch their inputs meanwhile.
struct ChunkRows {
  int64_t begin = 0, end = 0;
  bool first = true, last = true;
  int64_t size = 0;
  int64_t next_begin = 0, next_end = 0;
};

/// What the runner needs to plan the chunks of a call whose statistics are per row; every field
/// but local_bytes is agreed by the ranks (rows, dtype, statistics mode).
struct ChunkInfo {
  int64_t rows = 0;          ///< rows of the call
  int64_t width = 0;         ///< payload values per row
  int64_t reread_bytes = 0;  ///< input bytes per element the apply re-reads (x; x and dy)
  int64_t local_bytes = 0;   ///< this rank's re-read bytes (rows x columns x reread_bytes)
  /// Whether TPNORM_CHUNK=auto may chunk this op on a host (measured to pay there: the row
  /// norms); the others are chunked only when forced.
  bool host_auto = false;
};

class OpSpec {
 public:
  /// [in] name: a string literal naming the public call, e.g. "layer_norm_forward".
  OpSpec(const char* name, Stats stats, bool check_agreement)
      : name_(name), stats_(stats), check_agreement_(check_agreement) {}
  virtual ~OpSpec() = default;
  OpSpec(const OpSpec&) = delete;
  OpSpec& operator=(const OpSpec&) = delete;

  const char* name() const { return name_; }
  Stats stats() const { return stats_; }
  bool check_agreement() const { return check_agreement_; }
  /// False for a call that needs no statistics of other ranks (SyncBatchNorm in eval with
  /// running statistics): run_op then validates on a single-process call, makes no collective
  /// and the communicator's call sequence only counts collectives.
  virtual bool collective() const { return true; }

  /// Local checks, one per line (see Validator: after the first failure the rest are no-ops).
  virtual void validate(Validator& v) const = 0;
  /// The fields every rank must agree on (PackedCall::agree), in a fixed order.
  virtual void agree(PackedCall& call) const = 0;
  /// The payload of this rank (device_scratch is used only when the device hooks run).
  virtual PayloadSize payload() const = 0;

  /// Host (CPU kernel) hooks. partial runs only when this rank's validation passed; it writes
  /// the payload (call.payload_data(), zeroed). apply runs after a successful reduce (or, for a
  /// non-collective call, on this rank's own checks) and may throw the same error on every rank
  /// from reduced values (e.g. check_naive_count on call.global_count()).
  virtual void partial(PackedCall& call) = 0;
  virtual void apply(PackedCall& call) = 0;

  /// Device hooks, on `dev`'s stream; the device call checks the summed header on device.
  virtual bool has_device_kernels() const { return false; }
  /// Whether the device hooks also run Stats::kExact (int64 limbs); run_op refuses an exact
  /// call on a device communicator otherwise.
  virtual bool has_device_exact() const { return false; }
  virtual void partial_device(PackedCall&, DeviceCommunicator&) {}
  virtual void apply_device(PackedCall&, DeviceCommunicator&) {}
  /// True (from agreed fields only) when the device call changes host state that must advance
  /// only for an accepted call (SyncBatchNorm's num_batches_tracked): run_op then checks the
  /// call's header on the host first, as strict calls do, and refuses to capture it.
  virtual bool needs_host_verdict() const { return false; }

  /// Row chunks (ops/chunking.h, run_op.cpp). A spec whose statistics are per row may be run
  /// chunk by chunk: partial_rows writes the payload rows [begin, end) (payload values from
  /// begin * width on), apply_rows finishes the outputs of those rows from them. chunkable()
  /// depends only on the op (the same on every rank), chunk_info() on agreed fields. The
  /// partial and apply hooks above stay the one-chunk form.
  virtual bool chunkable(bool on_device) const {
    (void)on_device;
    return false;
  }
  virtual ChunkInfo chunk_info() const { return {}; }
  virtual void partial_rows(PackedCall&, const ChunkRows&) {}
  virtual void apply_rows(PackedCall&, const ChunkRows&) {}
  virtual void partial_rows_device(PackedCall&, DeviceCommunicator&, const ChunkRows&) {}
  virtual void apply_rows_device(PackedCall&, DeviceCommunicator&, const ChunkRows&) {}

 private:
  const char* name_;
  Stats stats_;
  bool check_agreement_;
};

/// The device hooks of a spec whose state is `Args`: two functions of ops/cuda, or none;
/// `exact` when they also run Stats::kExact.
template <class Args>
struct DeviceHooks {
  void (*partial)(PackedCall&, DeviceCommunicator&, const Args&) = nullptr;
  void (*apply)(PackedCall&, DeviceCommunicator&, const Args&) = nullptr;
  /// The same on rows [begin, end) of a chunked call (OpSpec::partial_rows); optional.
  void (*partial_rows)(PackedCall&, DeviceCommunicator&, const Args&, const ChunkRows&) = nullptr;
  void (*apply_rows)(PackedCall&, DeviceCommunicator&, const Args&, const ChunkRows&) = nullptr;
  bool exact = false;  ///< the hooks also run Stats::kExact
};

/// An OpSpec whose state is one `Args` (the call's views, options and geometry), with the
/// device hooks as functions of it: a spec derives from SpecOf<Args> and fills the host hooks.
/// Args holds views and options by value, so a spec stays valid after the public call's
/// arguments are gone (what a split-phase start/finish needs); only the memory the views point
/// to (and SyncBatchNorm's num_batches_tracked) must outlive the call.
template <class Args>
class SpecOf : public OpSpec {
 public:
  /// [in] opt: the call's options (NormOptions, BatchNormOptions: stats, check_agreement).
  template <class Options>
  SpecOf(const char* name, const Options& opt, const Args& args, DeviceHooks<Args> device = {})
      : OpSpec(name, opt.stats, opt.check_agreement), args_(args), device_(device) {}

  bool has_device_kernels() const final { return device_.partial && device_.apply; }
  bool has_device_exact() const final { return has_device_kernels() && device_.exact; }
  void partial_device(PackedCall& call, DeviceCommunicator& dev) final {
    device_.partial(call, dev, args_);
  }
  void apply_device(PackedCall& call, DeviceCommunicator& dev) final {
    device_.apply(call, dev, args_);
  }
  void partial_rows_device(PackedCall& call, DeviceCommunicator& dev, const ChunkRows& c) final {
    device_.partial_rows(call, dev, args_, c);
  }
  void apply_rows_device(PackedCall& call, DeviceCommunicator& dev, const ChunkRows& c) final {
    device_.apply_rows(call, dev, args_, c);
  }

 protected:
  Args args_;

 private:
  DeviceHooks<Args> device_;

 protected:
  /// Whether the device hooks include the chunk forms (for chunkable()).
  bool has_device_chunks() const { return device_.partial_rows && device_.apply_rows; }
};

/// One call of `op` on `comm` in its two phases (the split-phase cut, tpnorm/split.h). The
/// constructor is the start: validate -> agree -> prepare -> the header check's sum (strict
/// host calls, under the partial) -> partial -> the payload's sum, started; finish() waits
/// for it and applies.
///
/// A large call of a chunkable spec is cut into K row chunks (ops/chunking.h: the rule, and
/// TPNORM_CHUNK to force it off or on): the header is checked first, then start runs
/// partial(0), sum(0), partial(1), sum(1), and finish runs wait(0) + apply(0), partial(2),
/// sum(2), wait(1) + apply(1), ...: chunk k's sum is in flight while chunk k+1's partial runs,
/// and chunk k's apply re-reads its inputs while they are still in cache. K collectives, each
/// counted; below the rule's threshold one collective, as before. Either throws tpnorm::Error, the same on every rank, when any rank's
/// call is invalid or they disagree; outputs are then untouched. Destroyed without finish()
/// (a dropped handle): the sums in flight complete, nothing is written, and the next
/// collective call on `comm` fails on every rank, naming this call.
class StartedOp {
 public:
  StartedOp(Communicator& comm, OpSpec& op);
  /// The same, owning its spec (a split-phase handle outlives the public call that made it).
  StartedOp(Communicator& comm, std::unique_ptr<OpSpec> op);
  ~StartedOp();
  StartedOp(const StartedOp&) = delete;
  StartedOp& operator=(const StartedOp&) = delete;

  /// Waits for the call's collective and applies. Once; a second call does nothing.
  void finish();
  bool finished() const { return finished_; }

  /// Collectives of the payload: the plan's chunks (1 when not chunked).
  int64_t chunks() const { return plan_.chunks; }

 private:
  void start();
  // Row chunks: plan after the header's check; run chunk k's partial (host or device), start
  // its sum; wait for it and apply.
  void plan_chunks(const ChunkInfo& info, const chunking::Request& req);
  ChunkRows chunk(int64_t k) const;
  void partial_chunk(int64_t k);
  // A partial that failed after the call header was checked: thrown at one rank, else the job
  // ends (the peers would apply this rank's missing statistics).
  [[noreturn]] void failed_after_header(const std::string& what);
  void start_chunk(int64_t k);
  void apply_chunk(int64_t k);

  std::unique_ptr<OpSpec> owned_;
  OpSpec& op_;
  Communicator& comm_;
  // The call's NVTX range (device calls only; common/nvtx.h): a member, so that a start that
  // throws still ends it.
  nvtx::CallRange trace_;
  // A call that communicates nothing validates on a single-process call, so that a local
  // error cannot strand a peer and the communicator's sequence only counts collectives.
  std::unique_ptr<Communicator> local_;
  PackedCall call_;
  DeviceCommunicator* dev_ = nullptr;
  bool on_device_ = false;
  bool finished_ = false;
  // Chunked calls: the plan (1 chunk: the one-collective path) and how far the pipeline is.
  chunking::Plan plan_;
  int64_t rows_ = 0, width_ = 0;
  int64_t partials_ = 0;  // chunks whose partial has run
  std::vector<Communicator::Request> sums_;  // started chunk sums, in chunk order
  // The slice table (ops/slices.h) after the op's payload: this rank's slice, where the table
  // starts, and its values (0: none).
  Slice slice_;
  size_t table_at_ = 0, table_values_ = 0;
};

/// Starts `op` on `comm` for the split-phase API (tpnorm/split.h); the handle owns the spec.
/// Unless a BlockingCall is active on this thread, the sums the start left in flight are handed
/// to the communicator's progress (Communicator::progress_in_background).
PendingCall start_op(Communicator& comm, std::unique_ptr<OpSpec> op);

/// Marks a blocking public call (its own `_start(...).finish()`) on the calling thread: its
/// wait follows the start at once, so handing its sums to a progress thread would only cost a
/// wake-up. A scope, so that nested or throwing calls restore it.
class BlockingCall {
 public:
  BlockingCall() noexcept { ++depth(); }
  ~BlockingCall() { --depth(); }
  BlockingCall(const BlockingCall&) = delete;
  BlockingCall& operator=(const BlockingCall&) = delete;
  static bool active() noexcept { return depth() > 0; }

 private:
  static int& depth() noexcept {
    thread_local int d = 0;
    return d;
  }
};

/// Runs `op` on `comm`: start and finish at once (the blocking calls).
inline void run_op(Communicator& comm, OpSpec& op) { StartedOp(comm, op).finish(); }

}  // namespace tpnorm::detail
