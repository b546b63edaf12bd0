// run_op.cpp — the one runner of every op (see op_spec.h for the phases and the hooks).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <utility>

#include "common/exact_sum.h"
#include "common/nvtx.h"
#include "ops/op_spec.h"
#include "tpnorm/error.h"

namespace tpnorm::detail {

void check_naive_count(Stats s, double n, const char* op, const char* per) {
  if (s == Stats::kNaive && n >= kNaiveCountLimit)
    throw Error(ErrorCode::kInvalidArgument,
                std::string("tpnorm: ") + op +
                    ": the naive statistics mode supports fewer than 2^24 elements per " + per +
                    "; use Stats::kRobust");
  if (s == Stats::kExact && n >= exact::kMaxCount)
    throw Error(ErrorCode::kInvalidArgument,
                std::string("tpnorm: ") + op +
                    ": the exact statistics mode supports fewer than 2^32 elements per " + per +
                    "; use Stats::kRobust");
}

namespace {

// PackedCall::prepare on the device workspace. A pool that may not grow while the stream is
// being captured (kInvalidArgument, comm/cuda/workspace.h) is a misuse found before anything
// of the call is enqueued or captured. Whether it must grow depends on this rank's own sizes
// (a backward's scratch follows the local h), so with uneven shards it can happen on one rank
// only: captured calls are strict (StartedOp::start), and the growth is this rank's failure,
// which the host check of the header makes every rank throw, before any rank captures the
// collective. A single-process communicator has no peer and throws it. An allocation that
// fails is this rank's failure too: in a strict call the host pre-check makes every rank throw
// together; after the strict calls the rank cannot join a collective of the others' length,
// so it ends the job (DeviceCommunicator::abort_job) instead of stranding them.
void prepare_device(PackedCall& call, Communicator& comm, DeviceCommunicator& dev,
                    const PayloadSize& size) {
  // A rank that cannot take part fails the call and, outside the strict window (where the
  // failure rides in the agreed header), ends the job instead of stranding its peers.
  auto cannot_join = [&](const char* what) {
    call.fail(std::string("the device workspace could not grow: ") + what,
              ErrorCode::kCommunication);
    if (!comm.strict_now())
      dev.abort_job("tpnorm: rank " + std::to_string(comm.rank()) + " of " +
                    std::to_string(comm.size()) + ": cannot join the call's collective: " +
                    what + "; ending the job (the other ranks would wait forever)");
  };
  try {
    call.prepare(size.values, size.local_count, call.failed() ? 0 : size.device_scratch);
  } catch (const Error& e) {
    if (comm.size() == 1) throw;
    if (e.code() == ErrorCode::kInvalidArgument && call.strict())
      return call.fail(e.what(), ErrorCode::kInvalidArgument);
    if (e.code() == ErrorCode::kInvalidArgument) throw;  // not captured: every rank's misuse
    cannot_join(e.what());
  } catch (const std::exception& e) {
    if (comm.size() == 1) throw;
    cannot_join(e.what());
  }
}

// Returns the call's workspace region to the pool when finish() leaves, by return or throw.
struct ReleaseOnExit {
  PackedCall& call;
  ~ReleaseOnExit() { call.release_workspace(); }
};

// Device calls get an NVTX range named after the public call (a string literal).
const char* traced(const Communicator& comm, const OpSpec& op) {
  return comm.device().kind != DeviceKind::CPU ? op.name() : nullptr;
}

// The chunk rule (ops/chunking.h): on a host, chunks of half of a 1 MiB L2 (host_rule), auto
// on (measured to pay at 2 ranks); on a device, chunks of a quarter of an H200's 50 MB L2, auto
// off (not measured yet; TPNORM_CHUNK=on uses that size). The plan decides how many
// collectives a call makes, so it must not depend on what one process reads of its own
// machine: the host rule takes the L2 of the cores it was measured on (1 MiB), not this
// core's, so that ranks on unlike CPUs (a job across unlike nodes) plan the same chunks.
chunking::Rule chunk_rule(bool on_device) {
  if (on_device) {
    chunking::Rule r;
    r.auto_chunks = false;
    r.chunk_bytes = int64_t{12} << 20;
    return r;
  }
  static const chunking::Rule host = chunking::host_rule(chunking::kHostRuleL2);
  return host;
}

// TPNORM_CHUNK as an agreement field: ranks that would plan differently disagree. Auto is
// two values where a started call would not chunk and a blocking one could (see start()).
double chunk_field(const chunking::Request& r, bool started_unchunked) {
  if (r.mode == chunking::Mode::kOff) return -1;
  if (r.mode == chunking::Mode::kAuto) return started_unchunked ? -3 : -2;
  return static_cast<double>(r.rows);
}

}  // namespace

StartedOp::StartedOp(Communicator& comm, OpSpec& op)
    : op_(op),
      comm_(comm),
      trace_(traced(comm, op_)),
      local_(op.collective() ? nullptr : make_single_communicator()),
      call_(local_ ? *local_ : comm, op.name(), wire_of(op.stats()), op.check_agreement()) {
  start();
}

StartedOp::StartedOp(Communicator& comm, std::unique_ptr<OpSpec> op)
    : owned_(std::move(op)),
      op_(*owned_),
      comm_(comm),
      trace_(traced(comm, op_)),
      local_(op_.collective() ? nullptr : make_single_communicator()),
      call_(local_ ? *local_ : comm, op_.name(), wire_of(op_.stats()), op_.check_agreement()) {
  start();
}

StartedOp::~StartedOp() {
  // Constructed means started: a start that threw never gets here. call_'s destructor
  // completes the sums every rank started; a chunked call's are here. A chunked call dropped
  // without finish() still makes its remaining chunks' sums (with their partials, so that a peer
  // that does finish gets the right statistics): every rank makes the same collectives.
  if (!finished_ && plan_.chunks > 1) {
    try {
      for (auto k = static_cast<int64_t>(sums_.size()); k < plan_.chunks; ++k) {
        if (partials_ <= k) partial_chunk(k);
        start_chunk(k);
      }
    } catch (...) {
    }
  }
  for (Communicator::Request& r : sums_) {
    try {
      comm_.wait(r);
    } catch (...) {
    }
  }
  if (!finished_ && op_.collective())
    comm_.note_abandoned_call("a started " + std::string(op_.name()) + " (call " +
                              std::to_string(call_.sequence()) +
                              " on this communicator) was destroyed without finish(); its "
                              "outputs were not written");
}

void StartedOp::start() {
  Validator v(call_, comm_.device(), op_.stats());
  if (op_.collective()) {
    const std::string abandoned = comm_.take_abandoned_call();
    if (!abandoned.empty()) call_.fail(abandoned);
  }
  if (comm_.device().kind != DeviceKind::CPU) {
    dev_ = dynamic_cast<DeviceCommunicator*>(&comm_);
    if (!dev_) call_.fail(PackedCall::kNoDeviceStream);  // already so for a collective call
    if (!op_.has_device_kernels())
      v.fail("comm", "is a device communicator; this op has CPU kernels only so far");
  }
  on_device_ = dev_ && op_.has_device_kernels();
  // A captured call on a communicator with a started call's sums still in flight would order
  // the graph after work enqueued outside it (the side stream's events, comm/cuda): refused
  // before anything is captured. Started calls and captures follow the same order on every
  // rank, so every rank refuses it.
  if (on_device_ && op_.collective() && dev_->capturing() && comm_.in_flight() > 0)
    throw Error(ErrorCode::kInvalidArgument,
                std::string("tpnorm: ") + op_.name() +
                    ": cannot be captured in a CUDA graph while a started call's sums are in "
                    "flight on this communicator (" +
                    std::to_string(comm_.in_flight()) + "); finish() it before the capture");
  // Stats::kExact: device kernels where the spec's hooks declare them (every op with device
  // hooks but the gated RMSNorm), and int64 limbs with headroom for kMaxRanks.
  if (op_.stats() == Stats::kExact && on_device_ && !op_.has_device_exact())
    v.fail("stats", std::string("Stats::kExact has CPU kernels only so far for ") + op_.name() +
                        "; use a host communicator or Stats::kRobust");
  if (op_.stats() == Stats::kExact && comm_.size() > exact::kMaxRanks)
    v.fail("stats", "Stats::kExact supports at most " + std::to_string(exact::kMaxRanks) +
                        " ranks, the communicator has " + std::to_string(comm_.size()));

  op_.validate(v);
  op_.agree(call_);
  // Row chunks (ops/chunking.h): every rank reads the same TPNORM_CHUNK (agreed); forced
  // chunking checks the header first in every call, as strict calls do.
  const bool chunkable = op_.collective() && op_.chunkable(on_device_);
  chunking::Request req;
  const ChunkInfo info = chunkable ? op_.chunk_info() : ChunkInfo{};
  // Auto chunks a host call only when it is blocking (see may_chunk); where that can make a
  // difference it is agreed, so that ranks mixing a blocking and a started call there disagree
  // on every rank instead of making different collectives.
  const bool host_auto = !on_device_ && comm_.size() > 1 && info.host_auto;
  const bool blocking = BlockingCall::active();
  if (chunkable) {
    req = chunking::parse(std::getenv("TPNORM_CHUNK"));
    call_.agree("chunking", chunk_field(req, host_auto && !blocking));
    if (req.mode == chunking::Mode::kOn) call_.force_strict();
  }
  // A device call whose host state must advance only when it is accepted learns the verdict
  // on the host (the header's control sum, as strict calls); a graph would replay the host
  // state frozen at capture, so capturing it is refused before anything is captured.
  if (on_device_ && op_.collective() && op_.needs_host_verdict()) {
    if (dev_->capturing())
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("tpnorm: ") + op_.name() +
                      ": a training call that advances num_batches_tracked cannot be captured "
                      "in a CUDA graph (replays would not advance the host counter nor the "
                      "cumulative momentum); pass no num_batches_tracked and a fixed momentum "
                      "to capture it, or run it outside the graph");
    call_.force_strict();
  }
  // Captured calls are strict where the control sum works during a capture (its host check
  // runs once, at capture; replays have none), so that a rank whose workspace would have to
  // grow during the capture fails the call on every rank (prepare_device) instead of throwing
  // alone while its peers capture the collective. A borrowed NCCL communicator's control sum
  // goes through the stream: there the growth is still thrown by the rank alone.
  if (on_device_ && op_.collective() && comm_.size() > 1 && dev_->capturing() &&
      dev_->control_while_capturing())
    call_.force_strict();
  PayloadSize size = op_.payload();
  // The slice table (ops/slices.h) rides after the op's payload: every rank's slice, checked
  // after the reduce, so that slices that overlap or leave a gap fail on every rank.
  if (size.slice.present() && op_.collective() && !chunkable) {
    slice_ = size.slice;
    table_at_ = size.values;
    table_values_ = slice_table_values(comm_.size());
    size.values += table_values_;
  }
  if (on_device_ && op_.collective()) {
    prepare_device(call_, comm_, *dev_, size);
  } else {
    call_.prepare(size.values, size.local_count);
    // A device call without a collective (eval SyncBatchNorm) still needs its own scratch.
    if (on_device_ && !call_.failed() && size.device_scratch > 0)
      call_.prepare_local_scratch(*dev_, size.device_scratch);
  }
  // Every field and this rank's verdict are known: the header's sum may start now and run
  // under the partial (strict host calls; nothing otherwise).
  if (op_.collective()) call_.begin_check();

  // Chunks need the global column count, i.e. the header's sum: auto chunking runs on strict
  // calls at P > 1 (on MPI communicators every call is strict) where the rule allows it (host
  // calls of at least min_chunks chunks per rank: see chunk_rule), forced chunking on every
  // call. A rank whose own share is large waits for the header before its partial, so that its
  // chunks' partials can be pipelined; the others run the whole partial first (its latency
  // stays hidden) and plan after it. Both plan the same chunks from agreed values.
  const chunking::Rule rule = chunk_rule(on_device_);
  // Planning needs the header's own sum first: auto leaves a call whose header would ride in
  // its one sum (a small payload) at one collective, unless it has rule.header_rows rows (then
  // one more small sum, so that a large call with a small payload, RMSNorm's 4096 rows, can be
  // chunked). Both are agreed (rows, payload size, P). On a host auto chunks only the ops
  // measured to pay (ChunkInfo::host_auto: the row norms, not the fused residual norms nor
  // SyncBatchNorm), and never a started call (tpnorm/split.h, no BlockingCall scope): its
  // caller overlaps the call's one collective with its own work, and the chunks' sums, waited
  // one by one inside finish() after their partials, would bring the wait back (measured with
  // examples/overlap: 3-17 ms in finish() instead of ~5 us). TPNORM_CHUNK=on still chunks it.
  const bool may_chunk =
      chunkable && call_.strict() && info.rows >= 2 && req.mode != chunking::Mode::kOff &&
      (req.mode == chunking::Mode::kOn ||
       (rule.auto_chunks && (on_device_ || (host_auto && blocking)) && comm_.size() > 1 &&
        (!call_.check_in_sum() || info.rows >= rule.header_rows)));
  // Device calls always take the pipelined path: the chunked backward adds its column sums
  // chunk by chunk into chunk 0's scratch slices (ops/cuda/row_chunks_cuda.h), which one whole
  // partial would not leave.
  bool header_first = false;  // checked before the partial: its failure cannot reach the peers
  if (may_chunk && !call_.failed() &&
      (req.mode == chunking::Mode::kOn || on_device_ ||
       info.local_bytes >= rule.min_chunks * rule.chunk_bytes)) {
    {
      nvtx::Phase phase(trace_, "collective");
      call_.check_header_first();  // throws on every rank together
      header_first = true;
    }
    plan_chunks(info, req);
    if (plan_.chunks > 1) {
      for (int64_t k = 0; k < std::min<int64_t>(plan_.depth + 1, plan_.chunks); ++k) {
        partial_chunk(k);
        start_chunk(k);
      }
      return;
    }
  }

  // Nothing below writes an output before the collective has confirmed that every rank's call
  // is valid and agrees, and nothing before the collective keeps a rank out of it: a partial
  // that throws (a device that cannot be made current, a kernel that did not launch) is this
  // rank's failure, which every rank then sees.
  if (!call_.failed()) {
    nvtx::Phase phase(trace_, "partial");
    try {
      if (on_device_)
        op_.partial_device(call_, *dev_);
      else
        op_.partial(call_);
      if (table_values_ > 0) call_.write_slice(table_at_, slice_.offset, slice_.count);
    } catch (const Error& e) {
      if (header_first) failed_after_header(e.what());
      call_.fail(e.what(), e.code());
    } catch (const std::exception& e) {
      if (header_first) failed_after_header(e.what());
      call_.fail(e.what(), on_device_ ? ErrorCode::kCommunication : ErrorCode::kInternal);
    }
  }
  if (op_.collective()) {
    nvtx::Phase phase(trace_, "collective");
    if (may_chunk) {  // the whole partial ran before the plan: start every chunk's sum now
      call_.check_header_first();
      plan_chunks(info, req);
      if (plan_.chunks > 1) {
        partials_ = plan_.chunks;
        for (int64_t k = 0; k < plan_.chunks; ++k) start_chunk(k);
        return;
      }
    }
    call_.start_reduce();
  } else {
    call_.throw_if_failed_locally(comm_.rank());
  }
}

void StartedOp::plan_chunks(const ChunkInfo& info, const chunking::Request& req) {
  chunking::Shape s;
  s.rows = info.rows;
  s.columns = static_cast<int64_t>(call_.global_count());
  s.ranks = comm_.size();
  s.reread_bytes = info.reread_bytes;
  plan_ = chunking::plan(s, chunk_rule(on_device_), req);
  rows_ = info.rows;
  width_ = info.width;
  if (plan_.chunks > 1) sums_.reserve(static_cast<size_t>(plan_.chunks));
}

ChunkRows StartedOp::chunk(int64_t k) const {
  return {plan_.begin(k), plan_.end(k, rows_), k == 0, k + 1 == plan_.chunks, plan_.chunk_rows};
}

// After the header's check every rank relies on this rank's statistics: a partial that throws
// now cannot be reported in the collective any more, so it ends the job (as PackedCall does for
// a partial that fails after a strict header was sent); at one rank it is thrown. Applying the
// summed statistics anyway would write every rank's outputs from this rank's missing ones.
void StartedOp::failed_after_header(const std::string& what) {
  if (comm_.size() == 1) throw Error(ErrorCode::kInternal, what);
  comm_.abort_job("tpnorm: rank " + std::to_string(comm_.rank()) + " of " +
                  std::to_string(comm_.size()) + ": " + op_.name() +
                  " failed after its call header was checked: " + what +
                  "; ending the job (the other ranks would use this rank's missing statistics)");
}

void StartedOp::partial_chunk(int64_t k) {
  nvtx::Phase phase(trace_, "partial");
  try {
    if (on_device_)
      op_.partial_rows_device(call_, *dev_, chunk(k));
    else
      op_.partial_rows(call_, chunk(k));
  } catch (const std::exception& e) {
    if (comm_.size() == 1) throw;  // no peer relies on this rank's statistics
    failed_after_header(std::string("chunk ") + std::to_string(k) + ": " + e.what());
  }
  partials_ = k + 1;
}

void StartedOp::start_chunk(int64_t k) {
  nvtx::Phase phase(trace_, "collective");
  const ChunkRows c = chunk(k);
  const auto w = static_cast<size_t>(width_);
  sums_.push_back(call_.start_slice(static_cast<size_t>(c.begin) * w,
                                    static_cast<size_t>(c.end - c.begin) * w));
}

void StartedOp::apply_chunk(int64_t k) {
  {
    nvtx::Phase phase(trace_, "collective");
    comm_.wait(sums_[static_cast<size_t>(k)]);
  }
  nvtx::Phase phase(trace_, "apply");
  if (on_device_) {
    op_.apply_rows_device(call_, *dev_, chunk(k));
  } else {
    // The partial that runs after this apply (finish()'s order): its rows are prefetched.
    ChunkRows c = chunk(k);
    const int64_t n = k + plan_.depth + 1;
    if (n < plan_.chunks && partials_ <= n) {
      c.next_begin = plan_.begin(n);
      c.next_end = plan_.end(n, rows_);
    }
    op_.apply_rows(call_, c);
  }
}

void StartedOp::finish() {
  if (finished_) return;
  finished_ = true;  // a finish that throws (a failed call) is finished too: nothing to redo
  const ReleaseOnExit release{call_};
  if (plan_.chunks > 1) {
    // wait(0) + apply(0), partial(2), sum(2), wait(1) + apply(1), ... (plan_.depth = 1):
    // chunk k+1's sum is in flight while chunk k is applied, chunk k+2's partial runs while
    // chunk k+1's sum is; the apply of chunk k prefetches chunk k+2's inputs (apply_chunk).
    // An apply that throws (a check of the summed statistics, a kernel that did not launch)
    // ends the applies, not the sums: the remaining chunks' partials and sums still run, as on
    // every peer, and the error is thrown once they are started (their waits are the
    // destructor's).
    std::exception_ptr failure;
    for (int64_t k = 0; k < plan_.chunks; ++k) {
      const int64_t next = std::min(k + plan_.depth, plan_.chunks - 1);
      for (auto j = static_cast<int64_t>(sums_.size()); j <= next; ++j) {
        if (partials_ <= j) partial_chunk(j);
        start_chunk(j);
      }
      if (failure) continue;
      try {
        apply_chunk(k);
      } catch (...) {
        failure = std::current_exception();
      }
    }
    trace_.end();
    if (failure) std::rethrow_exception(failure);
    return;
  }
  if (op_.collective()) {
    nvtx::Phase phase(trace_, "collective");
    call_.finish_reduce();
  }
  // The summed slice table: read here on a host; on a device a kernel marks the summed header
  // failed when it does not tile (the apply kernels then write nothing, as for any failure).
  if (table_values_ > 0) {
    if (on_device_)
      call_.check_slices_on_device(table_at_, slice_.total);
    else
      check_slice_table(call_.read_payload(table_at_, table_values_), comm_.size(), slice_,
                        op_.name());
  }
  {
    nvtx::Phase phase(trace_, "apply");
    if (on_device_)
      op_.apply_device(call_, *dev_);
    else
      op_.apply(call_);
  }
  trace_.end();
}

}  // namespace tpnorm::detail
