// batch_norm_reference.cpp — see batch_norm_reference.h. Straightforward float64 code.
#include "batch_norm_reference.h"

#include <cmath>

namespace tpnorm_test {
namespace {

double at(const std::vector<float>& v, int64_t i, double dflt) {
  return v.empty() ? dflt : static_cast<double>(v[i]);
}

// y and dx from fixed per-channel statistics; `batch` adds the terms that flow through them.
void apply(BnRef& r, const std::vector<float>& x, int64_t n, int64_t c, int64_t inner,
           const std::vector<float>& gamma, const std::vector<float>& beta, double eps,
           const std::vector<float>& dy, bool batch) {
  const double count = static_cast<double>(n * inner);
  r.y.assign(x.size(), 0.0);
  if (!dy.empty()) {
    r.dx.assign(x.size(), 0.0);
    r.dgamma.assign(c, 0.0);
    r.dbeta.assign(c, 0.0);
  }
  for (int64_t ch = 0; ch < c; ++ch) {
    const double is = 1.0 / std::sqrt(r.var[ch] + eps), g = at(gamma, ch, 1.0);
    double sdy = 0, sdyx = 0;
    for (int64_t b = 0; b < n; ++b)
      for (int64_t s = 0; s < inner; ++s) {
        const int64_t i = (b * c + ch) * inner + s;
        const double xc = x[i] - r.mean[ch];
        r.y[i] = g * xc * is + at(beta, ch, 0.0);
        if (!dy.empty()) {
          sdy += dy[i];
          sdyx += dy[i] * xc;
        }
      }
    if (dy.empty()) continue;
    r.dgamma[ch] = sdyx * is;
    r.dbeta[ch] = sdy;
    for (int64_t b = 0; b < n; ++b)
      for (int64_t s = 0; s < inner; ++s) {
        const int64_t i = (b * c + ch) * inner + s;
        const double xc = x[i] - r.mean[ch];
        r.dx[i] =
            batch ? g * is * (dy[i] - sdy / count - xc * is * is * sdyx / count) : g * is * dy[i];
      }
  }
}

}  // namespace

BnRef batch_norm_reference(const std::vector<float>& x, int64_t n, int64_t c, int64_t inner,
                           const std::vector<float>& gamma, const std::vector<float>& beta,
                           double eps, const std::vector<float>& dy) {
  BnRef r;
  r.mean.assign(c, 0.0);
  r.var.assign(c, 0.0);
  const double count = static_cast<double>(n * inner);
  for (int64_t ch = 0; ch < c; ++ch) {
    for (int64_t b = 0; b < n; ++b)
      for (int64_t s = 0; s < inner; ++s) r.mean[ch] += x[(b * c + ch) * inner + s];
    r.mean[ch] /= count;
    for (int64_t b = 0; b < n; ++b)
      for (int64_t s = 0; s < inner; ++s) {
        const double d = x[(b * c + ch) * inner + s] - r.mean[ch];
        r.var[ch] += d * d;
      }
    r.var[ch] /= count;
  }
  apply(r, x, n, c, inner, gamma, beta, eps, dy, true);
  return r;
}

BnRef batch_norm_eval_reference(const std::vector<float>& x, int64_t n, int64_t c, int64_t inner,
                                const std::vector<float>& gamma, const std::vector<float>& beta,
                                const std::vector<double>& mean, const std::vector<double>& var,
                                double eps, const std::vector<float>& dy) {
  BnRef r;
  r.mean = mean;
  r.var = var;
  apply(r, x, n, c, inner, gamma, beta, eps, dy, false);
  return r;
}

template <class V>
V to_channels_last(const V& v, int64_t n, int64_t c, int64_t inner) {
  V out(v.size());
  for (int64_t b = 0; b < n; ++b)
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t s = 0; s < inner; ++s)
        out[(b * inner + s) * c + ch] = v[(b * c + ch) * inner + s];
  return out;
}
template <class V>
V from_channels_last(const V& v, int64_t n, int64_t c, int64_t inner) {
  V out(v.size());
  for (int64_t b = 0; b < n; ++b)
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t s = 0; s < inner; ++s)
        out[(b * c + ch) * inner + s] = v[(b * inner + s) * c + ch];
  return out;
}
template std::vector<float> to_channels_last(const std::vector<float>&, int64_t, int64_t, int64_t);
template std::vector<double> to_channels_last(const std::vector<double>&, int64_t, int64_t,
                                              int64_t);
template std::vector<float> from_channels_last(const std::vector<float>&, int64_t, int64_t,
                                               int64_t);
template std::vector<double> from_channels_last(const std::vector<double>&, int64_t, int64_t,
                                                int64_t);

}  // namespace tpnorm_test
