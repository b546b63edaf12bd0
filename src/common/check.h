// check.h — the one CHECK family for results of MPI, CUDA and NCCL calls.
//
// TPNORM_CHECK(kind, expr): evaluates expr once; on failure throws tpnorm::Error(kCommunication)
// naming the statement, file and line, and the library's own error string. `kind` is MPI,
// CUDA or NCCL; each has a traits overload of check_failed() next to its backend, so this
// header pulls in none of them.
#pragma once

#include <string>

#include "tpnorm/error.h"

namespace tpnorm::detail {

[[noreturn]] void throw_check_failure(const char* kind, const char* stmt, const char* file,
                                      int line, const std::string& detail);

}  // namespace tpnorm::detail

#define TPNORM_CHECK(kind, expr)                                    \
  do {                                                              \
    auto tpnorm_check_rc_ = (expr);                                 \
    if (!::tpnorm::detail::kind##_ok(tpnorm_check_rc_))             \
      ::tpnorm::detail::throw_check_failure(                        \
          #kind, #expr, __FILE__, __LINE__,                         \
          ::tpnorm::detail::kind##_error_string(tpnorm_check_rc_)); \
  } while (0)
