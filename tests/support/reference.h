// reference.h — float64 references on full, unsharded data (two-pass statistics).
#pragma once

#include <cstdint>
#include <vector>

namespace tpnorm_test {

struct RowRef {
  std::vector<double> y, mean, rstd;          // forward
  std::vector<double> dx, dgamma, dbeta;      // backward
};

/// LayerNorm (centered) or RMSNorm on x [rows, h]; gamma/beta may be empty (absent).
/// When dy is non-empty the backward is computed too.
RowRef row_norm_reference(bool centered, const std::vector<float>& x, int64_t rows, int64_t h,
                          const std::vector<float>& gamma, const std::vector<float>& beta,
                          double eps, const std::vector<float>& dy = {});

}  // namespace tpnorm_test
