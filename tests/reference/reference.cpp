// reference.cpp — see reference.h. Straightforward float64 code, written for clarity.
#include "reference.h"

#include <algorithm>
#include <cmath>

namespace tpnorm_test {

RowRef row_norm_reference(bool centered, const std::vector<float>& x, int64_t rows, int64_t h,
                          const std::vector<float>& gamma, const std::vector<float>& beta,
                          double eps, const std::vector<float>& dy) {
  RowRef r;
  r.y.resize(x.size());
  r.mean.resize(rows);
  r.rstd.resize(rows);
  const bool bwd = !dy.empty();
  if (bwd) {
    r.dx.resize(x.size());
    r.dgamma.assign(h, 0.0);
    r.dbeta.assign(h, 0.0);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float* xr = x.data() + i * h;
    double mu = 0, var = 0;
    if (h > 0) {
      if (centered) {
        for (int64_t j = 0; j < h; ++j) mu += xr[j];
        mu /= h;
      }
      for (int64_t j = 0; j < h; ++j) var += (xr[j] - mu) * (xr[j] - mu);
      var /= h;
    }
    const double rs = 1.0 / std::sqrt(var + eps);
    r.mean[i] = mu;
    r.rstd[i] = rs;
    for (int64_t j = 0; j < h; ++j) {
      const double xhat = (xr[j] - mu) * rs;
      r.y[i * h + j] = xhat * (gamma.empty() ? 1.0 : gamma[j]) + (beta.empty() ? 0.0 : beta[j]);
    }
    if (!bwd) continue;
    double sg = 0, sgx = 0;
    for (int64_t j = 0; j < h; ++j) {
      const double xhat = (xr[j] - mu) * rs;
      const double g = dy[i * h + j] * (gamma.empty() ? 1.0 : gamma[j]);
      sg += g;
      sgx += g * xhat;
      r.dgamma[j] += dy[i * h + j] * xhat;
      r.dbeta[j] += dy[i * h + j];
    }
    for (int64_t j = 0; j < h; ++j) {
      const double xhat = (xr[j] - mu) * rs;
      const double g = dy[i * h + j] * (gamma.empty() ? 1.0 : gamma[j]);
      r.dx[i * h + j] = rs * (g - (centered ? sg / h : 0.0) - xhat * sgx / h);
    }
  }
  return r;
}

RowStatTol row_stat_tolerance(bool, const std::vector<float>&, int64_t, int64_t,
                              const std::vector<int64_t>&, const std::vector<int64_t>&,
                              const RowRef&) {
  return RowStatTol{};
}

}  // namespace tpnorm_test
