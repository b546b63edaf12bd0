// tpnorm/error.h — the one exception type tpnorm throws.
//
// Library code never calls exit() or abort(). A call that fails throws tpnorm::Error on EVERY
// rank of its communicator with the same message (the ranks agree on failure inside the call's
// one collective), so a bad argument on one rank cannot leave the others waiting. A failed call
// leaves its outputs, saved statistics and running statistics untouched.
#pragma once

#include <stdexcept>
#include <string>

namespace tpnorm {

enum class ErrorCode : int {
  kInvalidArgument = 1,  ///< a null pointer, a wrong shape, dtype or device, a bad eps ...
  kMismatch = 2,         ///< ranks disagree on the call (op, shape, dtype, eps, sequence)
  kCommunication = 3,    ///< the MPI / NCCL / CUDA layer reported an error
  kInternal = 4,         ///< anything else (e.g. std::bad_alloc on some rank)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace tpnorm
