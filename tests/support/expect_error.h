// expect_error.h — runs a tpnorm call that must fail on every rank together.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "harness.h"
#include "tpnorm/error.h"

namespace tpnorm_test {

// Runs fn on every rank; returns the message of the tpnorm::Error it threw ("" if none) and
// checks that every rank threw with code `want` and a message of the same length.
template <class Fn>
std::string error_of(Fn&& fn, tpnorm::ErrorCode want) {
  std::string msg;
  int code = 0;
  try {
    fn();
  } catch (const tpnorm::Error& e) {
    msg = e.what();
    code = static_cast<int>(e.code());
  }
  EXPECT_EQ(code, static_cast<int>(want)) << msg;
  const int64_t len = static_cast<int64_t>(msg.size());
  EXPECT_EQ(sum_over_ranks(len), len * world_size()) << "ranks report different errors: " << msg;
  return msg;
}

}  // namespace tpnorm_test
