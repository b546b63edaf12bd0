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

RowStatTol row_stat_tolerance(bool centered, const std::vector<float>& x, int64_t rows,
                              int64_t h, const std::vector<int64_t>& offset,
                              const std::vector<int64_t>& count, const RowRef& ref) {
  const double u16 = 16 * 0x1p-24;
  RowStatTol t;
  for (int64_t r = 0; r < rows; ++r) {
    const double mu = centered ? ref.mean[r] : 0.0;
    double abs_d = 0, sq_d = 0, cross = 0;
    for (size_t k = 0; k < count.size(); ++k) {
      if (count[k] == 0) continue;
      const double p = centered ? x[r * h + offset[k]] : 0.0;
      double a = 0;
      for (int64_t j = offset[k]; j < offset[k] + count[k]; ++j) {
        const double d = x[r * h + j] - p;
        a += std::fabs(d);
        sq_d += d * d;
      }
      abs_d += a;
      cross += 2 * std::fabs(p - mu) * a;
    }
    const double rs2 = ref.rstd[r] * ref.rstd[r];
    t.mean_atol = std::max(t.mean_atol, 1e-6 + u16 * abs_d / h);
    t.rstd_rtol = std::max(t.rstd_rtol, 1e-6 + u16 * (sq_d + cross) / h * rs2);
  }
  return t;
}

}  // namespace tpnorm_test
