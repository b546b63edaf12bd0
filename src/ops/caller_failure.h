// caller_failure.h — a failure found by code that wraps the ops before it can call one (the
// Python binding: a non-contiguous tensor, a dtype with no tpnorm equivalent), handed to the
// op's agreement so that it becomes the same tpnorm::Error on every rank. Throwing it locally
// instead would leave the other ranks waiting in the op's collective.
#pragma once

#include <string>

#include "tpnorm/error.h"

namespace tpnorm::detail {

/// Records `message` as this thread's pending failure: the next PackedCall made on this thread
/// takes it as its first failure (and clears it). The caller still makes the op call, with the
/// offending view's data set to null and its shape kept, so every rank's collective has the
/// same size. An empty message clears a pending failure.
void set_caller_failure(const std::string& message, ErrorCode code = ErrorCode::kInvalidArgument);

}  // namespace tpnorm::detail
