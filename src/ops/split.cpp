// split.cpp — PendingCall, the public handle of a started call (tpnorm/split.h); the call
// itself is a detail::StartedOp (ops/op_spec.h), the one runner of blocking calls too.
#include "tpnorm/split.h"

#include <utility>

#include "ops/op_spec.h"

namespace tpnorm {

PendingCall::PendingCall() noexcept = default;
PendingCall::PendingCall(std::unique_ptr<detail::StartedOp> started) noexcept
    : started_(std::move(started)) {}
PendingCall::PendingCall(PendingCall&& other) noexcept = default;
PendingCall& PendingCall::operator=(PendingCall&& other) noexcept = default;
PendingCall::~PendingCall() = default;

void PendingCall::finish() {
  if (!started_) return;
  // Released first, so that after a throw nothing is pending; finish() marks it finished
  // before anything can throw, so its destructor does not report it as dropped.
  std::unique_ptr<detail::StartedOp> s = std::move(started_);
  s->finish();
}

namespace detail {

PendingCall start_op(Communicator& comm, std::unique_ptr<OpSpec> op) {
  PendingCall call(std::make_unique<StartedOp>(comm, std::move(op)));
  if (!BlockingCall::active()) comm.progress_in_background();
  return call;
}

}  // namespace detail
}  // namespace tpnorm
