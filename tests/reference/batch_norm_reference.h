// batch_norm_reference.h — float64 BatchNorm on the full, concatenated batch (two-pass
// statistics), and the NCHW <-> channels-last transposes the layout tests need.
#pragma once

#include <cstdint>
#include <vector>

namespace tpnorm_test {

struct BnRef {
  std::vector<double> mean, var;      // per channel; var biased
  std::vector<double> y, dx;          // NCHW, like x
  std::vector<double> dgamma, dbeta;  // per channel, sums over the whole batch
};

/// Training-mode BatchNorm of x, NCHW [n, c, inner]; gamma/beta may be empty (absent). With
/// dy the backward is computed too.
BnRef batch_norm_reference(const std::vector<float>& x, int64_t n, int64_t c, int64_t inner,
                           const std::vector<float>& gamma, const std::vector<float>& beta,
                           double eps, const std::vector<float>& dy = {});

/// Eval-mode BatchNorm with fixed statistics: y = gamma*(x-mean)/sqrt(var+eps) + beta and
/// dx = gamma*dy/sqrt(var+eps).
BnRef batch_norm_eval_reference(const std::vector<float>& x, int64_t n, int64_t c, int64_t inner,
                                const std::vector<float>& gamma, const std::vector<float>& beta,
                                const std::vector<double>& mean, const std::vector<double>& var,
                                double eps, const std::vector<float>& dy);

/// [n, c, inner] -> [n, inner, c] and back.
template <class V>
V to_channels_last(const V& v, int64_t n, int64_t c, int64_t inner);
template <class V>
V from_channels_last(const V& v, int64_t n, int64_t c, int64_t inner);

}  // namespace tpnorm_test
