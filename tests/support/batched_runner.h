// batched_runner.h — runs tpnorm's batched_norm_forward + batched_norm_backward on float data.
#pragma once

#include <cstdint>
#include <vector>

#include "tpnorm/communicator.h"
#include "tpnorm/norm.h"
#include "tpnorm/tensor.h"

namespace tpnorm_test {

struct BatchedItem {
  bool centered = true;
  tpnorm::DType dt = tpnorm::DType::F32;     // storage dtype (inputs are rounded to it)
  tpnorm::DType saved = tpnorm::DType::F32;  // mean / rstd dtype
  int64_t rows = 0, h = 0;                   // this rank's shape
  bool affine = false;                       // gamma (and beta when centered) present
  std::vector<float> x, gamma, beta, dy;     // this rank's data
};

struct BatchedOut {
  std::vector<float> y, mean, rstd, dx, dgamma, dbeta;
};

/// One batched forward and, when `backward`, one batched backward over every item.
std::vector<BatchedOut> run_batched(tpnorm::Communicator& comm,
                                    const std::vector<BatchedItem>& items, bool backward = true,
                                    const tpnorm::NormOptions& opt = {});

}  // namespace tpnorm_test
