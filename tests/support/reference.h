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

/// Tolerances of the saved mean (absolute) and rstd (relative) of a robust-mode row norm whose
/// hidden dim is split as offset[k], count[k]. The robust row kernels (kernels/cpu/row_norm.cpp)
/// sum d = x - p and d^2 in float32 blocks around each shard's first element p (0 for RMSNorm):
/// up to ~16 float roundings of sum |d| and sum d^2. With mu the row mean, var then errs by at
/// most 16u (sum d^2 + 2|p - mu| sum |d|) / n, u = 2^-24, which exceeds a flat 1e-6 when a
/// shard's first element lies far from the mean (seen: p 2.5 standard deviations out, rstd off
/// by 1.4e-6 relative; how far depends on the compiler's summation order). Returns the largest
/// over rows of 1e-6 + 16u sum |d| / n (mean) and 1e-6 + that var error * rstd^2 (rstd).
struct RowStatTol {
  double mean_atol = 1e-6, rstd_rtol = 1e-6;
};
RowStatTol row_stat_tolerance(bool centered, const std::vector<float>& x, int64_t rows,
                              int64_t h, const std::vector<int64_t>& offset,
                              const std::vector<int64_t>& count, const RowRef& ref);

}  // namespace tpnorm_test
