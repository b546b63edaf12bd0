// c_api_common.h — what the C API's translation units share (c_api.cpp, and cuda/c_api_cuda.cpp
// in CUDA builds): the handle behind tpnorm_comm_t, and the guard that turns exceptions into a
// status plus this thread's message.
#pragma once

#include <memory>
#include <new>
#include <string>

#include "tpnorm/c_api.h"
#include "tpnorm/communicator.h"
#include "tpnorm/error.h"

struct tpnorm_comm_s {
  std::unique_ptr<tpnorm::Communicator> impl;
};

namespace tpnorm::capi {

/// Records `what` as this thread's last error and returns `s`.
tpnorm_status_t fail(tpnorm_status_t s, const std::string& what);

/// Runs fn, turning whatever it throws into a status; nothing escapes into C.
template <class Fn>
tpnorm_status_t guarded(Fn&& fn) {
  try {
    fn();
    return TPNORM_SUCCESS;
  } catch (const tpnorm::Error& e) {
    return fail(static_cast<tpnorm_status_t>(e.code()), e.what());
  } catch (const std::bad_alloc&) {
    return fail(TPNORM_INTERNAL, "tpnorm: out of memory");
  } catch (const std::exception& e) {
    return fail(TPNORM_INTERNAL, e.what());
  }
}

/// The communicator of a handle; throws kInvalidArgument for a null one.
inline tpnorm::Communicator* get(tpnorm_comm_t c) {
  if (!c || !c->impl)
    throw tpnorm::Error(tpnorm::ErrorCode::kInvalidArgument, "tpnorm: null communicator");
  return c->impl.get();
}

/// *out = a new handle owning make()'s communicator.
template <class Make>
tpnorm_status_t create(tpnorm_comm_t* out, Make&& make) {
  if (!out) return fail(TPNORM_INVALID_ARGUMENT, "tpnorm: 'out' is null");
  return guarded([&] { *out = new tpnorm_comm_s{make()}; });
}

}  // namespace tpnorm::capi
