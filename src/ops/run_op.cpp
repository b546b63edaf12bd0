// run_op.cpp — the one runner of every op (see op_spec.h for the phases and the hooks).
#include <exception>
#include <memory>
#include <string>

#include "ops/op_spec.h"
#include "tpnorm/error.h"

namespace tpnorm::detail {

void check_naive_count(Stats s, double n, const char* op, const char* per) {
  if (s == Stats::kNaive && n >= kNaiveCountLimit)
    throw Error(ErrorCode::kInvalidArgument,
                std::string("tpnorm: ") + op +
                    ": the naive statistics mode supports fewer than 2^24 elements per " + per +
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

}  // namespace

void run_op(Communicator& comm, OpSpec& op) {
  // A call that communicates nothing validates on a single-process call, so that a local error
  // cannot strand a peer and the communicator's sequence only counts collectives.
  std::unique_ptr<Communicator> local = op.collective() ? nullptr : make_single_communicator();
  PackedCall call(local ? *local : comm, op.name(), wire_of(op.stats()), op.check_agreement());
  Validator v(call, comm.device());

  DeviceCommunicator* dev = nullptr;
  if (comm.device().kind != DeviceKind::CPU) {
    dev = dynamic_cast<DeviceCommunicator*>(&comm);
    if (!dev) call.fail(PackedCall::kNoDeviceStream);  // already so for a collective call
    if (!op.has_device_kernels())
      v.fail("comm", "is a device communicator; this op has CPU kernels only so far");
  }
  const bool on_device = dev && op.has_device_kernels();

  op.validate(v);
  op.agree(call);
  const PayloadSize size = op.payload();
  if (on_device)
    prepare_device(call, comm, *dev, size);
  else
    call.prepare(size.values, size.local_count);

  // start: partial and the collective; finish: apply. Nothing below writes an output before
  // the collective has confirmed that every rank's call is valid and agrees, and nothing before
  // the collective keeps a rank out of it: a partial that throws (a device that cannot be made
  // current, a kernel that did not launch) is this rank's failure, which every rank then sees.
  if (!call.failed()) {
    try {
      if (on_device)
        op.partial_device(call, *dev);
      else
        op.partial(call);
    } catch (const Error& e) {
      call.fail(e.what(), e.code());
    } catch (const std::exception& e) {
      call.fail(e.what(), on_device ? ErrorCode::kCommunication : ErrorCode::kInternal);
    }
  }
  if (op.collective())
    call.reduce();
  else
    call.throw_if_failed_locally(comm.rank());
  if (on_device)
    op.apply_device(call, *dev);
  else
    op.apply(call);
}

}  // namespace tpnorm::detail
