// run_op.cpp — the one runner of every op (see op_spec.h for the phases and the hooks).
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

// PackedCall::prepare on the device workspace. A workspace that cannot grow is this rank's
// failure: in a strict call the host pre-check makes every rank throw together; after the
// strict calls the rank cannot join a collective of the others' length, so it ends the job
// (DeviceCommunicator::abort_job) instead of stranding them.
void prepare_device(PackedCall& call, Communicator& comm, DeviceCommunicator& dev,
                    const PayloadSize& size) {
  try {
    call.prepare(size.values, size.local_count, call.failed() ? 0 : size.device_scratch);
  } catch (const std::exception& e) {
    call.fail(std::string("the device workspace could not grow: ") + e.what(),
              ErrorCode::kCommunication);
    if (!comm.strict_now())
      dev.abort_job("tpnorm: rank " + std::to_string(comm.rank()) + " of " +
                    std::to_string(comm.size()) + ": cannot join the call's collective: " +
                    e.what() + "; ending the job (the other ranks would wait forever)");
  }
}

// Device calls get an NVTX range named after the public call (a string literal).
const char* traced(const Communicator& comm, const OpSpec& op) {
  return comm.device().kind != DeviceKind::CPU ? op.name() : nullptr;
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
  // completes the sums every rank started.
  if (!finished_ && op_.collective())
    comm_.note_abandoned_call("a started " + std::string(op_.name()) + " (call " +
                              std::to_string(call_.sequence()) +
                              " on this communicator) was destroyed without finish(); its "
                              "outputs were not written");
}

void StartedOp::start() {
  Validator v(call_, comm_.device());
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
  // Stats::kExact: CPU kernels only so far, and int64 limbs with headroom for kMaxRanks.
  if (op_.stats() == Stats::kExact && dev_)
    v.fail("stats",
           "Stats::kExact has CPU kernels only so far; use a host communicator or "
           "Stats::kRobust");
  if (op_.stats() == Stats::kExact && comm_.size() > exact::kMaxRanks)
    v.fail("stats", "Stats::kExact supports at most " + std::to_string(exact::kMaxRanks) +
                        " ranks, the communicator has " + std::to_string(comm_.size()));

  op_.validate(v);
  op_.agree(call_);
  const PayloadSize size = op_.payload();
  if (on_device_)
    prepare_device(call_, comm_, *dev_, size);
  else
    call_.prepare(size.values, size.local_count);
  // Every field and this rank's verdict are known: the header's sum may start now and run
  // under the partial (strict host calls; nothing otherwise).
  if (op_.collective()) call_.begin_check();

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
    } catch (const Error& e) {
      call_.fail(e.what(), e.code());
    } catch (const std::exception& e) {
      call_.fail(e.what(), on_device_ ? ErrorCode::kCommunication : ErrorCode::kInternal);
    }
  }
  if (op_.collective()) {
    nvtx::Phase phase(trace_, "collective");
    call_.start_reduce();
  } else {
    call_.throw_if_failed_locally(comm_.rank());
  }
}

void StartedOp::finish() {
  if (finished_) return;
  finished_ = true;  // a finish that throws (a failed call) is finished too: nothing to redo
  if (op_.collective()) {
    nvtx::Phase phase(trace_, "collective");
    call_.finish_reduce();
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
