// Single-process LayerNorm / RMSNorm against worked examples, a float64 reference and finite
// differences. Tolerances: fp32 outputs 1e-5 abs + 1e-5 rel; stats 1e-6 rel.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "harness.h"
#include "reference.h"
#include "tpnorm/norm.h"

using namespace tpnorm;
using tpnorm_test::count_wrong;

namespace {

struct Out {
  std::vector<float> y, mean, rstd, dx, dgamma, dbeta;
};

// Runs forward (and backward if dy is given) on one process.
Out run_rows(bool centered, const std::vector<float>& x, int64_t rows, int64_t h,
             const std::vector<float>& gamma, const std::vector<float>& beta,
             const std::vector<float>& dy = {}, NormOptions opt = {}) {
  auto comm = make_single_communicator();
  Out o;
  o.y.assign(x.size(), 0.f);
  o.mean.assign(rows, 0.f);
  o.rstd.assign(rows, 0.f);
  const Shape s{rows, h}, p{h}, r{rows};
  const TensorView g = gamma.empty() ? TensorView{} : view(gamma.data(), p);
  const TensorView b = beta.empty() ? TensorView{} : view(beta.data(), p);
  if (centered)
    layer_norm_forward(*comm, view(x.data(), s), g, b, view(o.y.data(), s), view(o.mean.data(), r),
                       view(o.rstd.data(), r), opt);
  else
    rms_norm_forward(*comm, view(x.data(), s), g, view(o.y.data(), s), view(o.rstd.data(), r), opt);
  if (dy.empty()) return o;
  o.dx.assign(x.size(), 0.f);
  o.dgamma.assign(h, 0.f);
  o.dbeta.assign(h, 0.f);
  if (centered)
    layer_norm_backward(*comm, view(dy.data(), s), view(x.data(), s), g, view(o.mean.data(), r),
                        view(o.rstd.data(), r), view(o.dx.data(), s), view(o.dgamma.data(), p),
                        view(o.dbeta.data(), p), opt);
  else
    rms_norm_backward(*comm, view(dy.data(), s), view(x.data(), s), g, view(o.rstd.data(), r),
                      view(o.dx.data(), s), view(o.dgamma.data(), p), opt);
  return o;
}

}  // namespace

TEST(RowNorm, SeedNotesWorkedRows) {
  // 003 seed: each of these rows normalizes to [-1.342, -0.447, 0.447, 1.342].
  const std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8, 2, 4, 6, 8};
  const Out o = run_rows(true, x, 3, 4, {}, {});
  const double want[4] = {-1.342, -0.447, 0.447, 1.342};
  for (int r = 0; r < 3; ++r)
    for (int j = 0; j < 4; ++j) EXPECT_NEAR(o.y[r * 4 + j], want[j], 1e-3) << r << "," << j;
  EXPECT_FLOAT_EQ(o.mean[0], 2.5f);
  EXPECT_FLOAT_EQ(o.mean[1], 6.5f);
  EXPECT_FLOAT_EQ(o.mean[2], 5.0f);
  EXPECT_NEAR(o.rstd[2], 1.0 / std::sqrt(5.0 + 1e-5), 1e-6);
  const auto ref = tpnorm_test::row_norm_reference(true, x, 3, 4, {}, {}, 1e-5);
  EXPECT_EQ(count_wrong("y", o.y, ref.y, 1e-6, 1e-6), 0);
}

TEST(RowNorm, ZeroVarianceRowGivesBeta) {
  const std::vector<float> x(6, 3.25f), gamma = {2, 2, 2, 2, 2, 2}, beta = {0.5f, -1, 2, 0, 7, -3};
  const Out o = run_rows(true, x, 1, 6, gamma, beta);
  for (int j = 0; j < 6; ++j) EXPECT_EQ(o.y[j], beta[j]);
  EXPECT_EQ(o.mean[0], 3.25f);
  EXPECT_NEAR(o.rstd[0], 1.0 / std::sqrt(1e-5), 1e-2);
}

TEST(RowNorm, RmsNormKnownVector) {
  // mean of squares of [1,2,3,4] = 7.5; y = x / sqrt(7.5 + eps)
  const std::vector<float> x = {1, 2, 3, 4};
  const Out o = run_rows(false, x, 1, 4, {}, {});
  const double want[4] = {0.365148, 0.730297, 1.095445, 1.460593};
  for (int j = 0; j < 4; ++j) EXPECT_NEAR(o.y[j], want[j], 1e-6);
}

class RowNormVsReference : public ::testing::TestWithParam<std::tuple<bool, int, int, bool>> {};

TEST_P(RowNormVsReference, ForwardAndBackward) {
  const auto [centered, rows, h, affine] = GetParam();
  const auto x = tpnorm_test::normal(1, 0, rows * h, 0.3, 2.0);
  const auto dy = tpnorm_test::normal(1, 1, rows * h);
  const auto gamma = affine ? tpnorm_test::normal(1, 2, h, 1.0, 0.5) : std::vector<float>{};
  const auto beta = affine ? tpnorm_test::normal(1, 3, h) : std::vector<float>{};
  const Out o = run_rows(centered, x, rows, h, gamma, centered ? beta : std::vector<float>{}, dy);
  const auto ref = tpnorm_test::row_norm_reference(
      centered, x, rows, h, gamma, centered ? beta : std::vector<float>{}, 1e-5, dy);
  EXPECT_EQ(count_wrong("y", o.y, ref.y, 1e-5, 1e-5), 0);
  EXPECT_EQ(count_wrong("rstd", o.rstd, ref.rstd, 0, 1e-6), 0);
  if (centered) {
    EXPECT_EQ(count_wrong("mean", o.mean, ref.mean, 1e-6, 1e-6), 0);
  }
  // dx scales with rstd (316 for a one-column row with eps 1e-5): tolerance relative to it.
  const double rs_max = *std::max_element(ref.rstd.begin(), ref.rstd.end());
  EXPECT_EQ(count_wrong("dx", o.dx, ref.dx, 1e-5 * std::max(1.0, rs_max), 1e-4), 0);
  EXPECT_EQ(count_wrong("dgamma", o.dgamma, ref.dgamma, 1e-5 * rows, 1e-5), 0);
  if (centered) {
    EXPECT_EQ(count_wrong("dbeta", o.dbeta, ref.dbeta, 1e-5 * rows, 1e-5), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RowNormVsReference,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(1, 71, 29),
                                            ::testing::Values(1, 229, 541, 4096),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "LayerNorm" : "RMSNorm") +
                                  "_" + std::to_string(std::get<1>(info.param)) + "x" +
                                  std::to_string(std::get<2>(info.param)) +
                                  (std::get<3>(info.param) ? "_affine" : "_plain");
                         });

// d(loss)/d(input) by central differences of the op itself, loss = sum(y * w).
TEST(RowNorm, FiniteDifferenceGradients) {
  for (bool centered : {true, false}) {
    const int64_t rows = 3, h = 7;
    auto x = tpnorm_test::normal(7, 0, rows * h, 0.5, 1.0);
    auto gamma = tpnorm_test::normal(7, 1, h, 1.0, 0.3);
    auto beta = tpnorm_test::normal(7, 2, h);
    const auto w = tpnorm_test::normal(7, 3, rows * h);
    auto loss = [&]() {
      const Out o = run_rows(centered, x, rows, h, gamma, centered ? beta : std::vector<float>{});
      double l = 0;
      for (size_t i = 0; i < o.y.size(); ++i) l += static_cast<double>(o.y[i]) * w[i];
      return l;
    };
    const Out o = run_rows(centered, x, rows, h, gamma, centered ? beta : std::vector<float>{}, w);
    auto fd = [&](std::vector<float>& v, size_t i) {
      const float keep = v[i], step = 1e-2f;
      v[i] = keep + step;
      const double lp = loss();
      v[i] = keep - step;
      const double lm = loss();
      v[i] = keep;
      return (lp - lm) / (2.0 * step);
    };
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(o.dx[i], fd(x, i), 2e-3) << "dx " << i;
    for (int64_t j = 0; j < h; ++j) EXPECT_NEAR(o.dgamma[j], fd(gamma, j), 2e-3) << "dgamma " << j;
    if (centered) {
      for (int64_t j = 0; j < h; ++j) EXPECT_NEAR(o.dbeta[j], fd(beta, j), 2e-3) << "dbeta " << j;
    }
  }
}

// 1e4 + N(0,1): float32 E[x^2]-E[x]^2 loses every digit of the variance; the default does not.
TEST(RowNorm, LargeOffsetRobustDefaultNaiveFails) {
  const int64_t rows = 16, h = 4096;
  const auto x = tpnorm_test::normal(3, 0, rows * h, 1e4, 1.0);
  const auto ref = tpnorm_test::row_norm_reference(true, x, rows, h, {}, {}, 1e-5);
  tpnorm_test::reset_max_abs_err();
  const Out robust = run_rows(true, x, rows, h, {}, {});
  EXPECT_EQ(count_wrong("y", robust.y, ref.y, 1e-4, 1e-4), 0);
  EXPECT_EQ(count_wrong("rstd", robust.rstd, ref.rstd, 0, 1e-5), 0);
  std::printf("1e4 offset, robust: max |y - ref| = %.3g\n", tpnorm_test::max_abs_err());
  NormOptions naive;
  naive.stats = Stats::kNaive;
  const Out bad = run_rows(true, x, rows, h, {}, {}, {}, naive);
  double worst = 0;
  for (size_t i = 0; i < bad.y.size(); ++i) worst = std::max(worst, std::fabs(bad.y[i] - ref.y[i]));
  std::printf("1e4 offset, naive:  max |y - ref| = %.3g\n", worst);
  EXPECT_GT(worst, 1e-2) << "naive float32 moments were expected to cancel here";
}

// Tensors past the last-level cache (32 MiB is typical) take the streaming-store
// path; rows of 4099 floats start at a different 64-byte offset each, so every row peels.
TEST(RowNorm, LargeTensorStreamingPath) {
  const int64_t rows = 1040, h = 4099;  // 17 MB a tensor: forward 34 MB, backward 51 MB
  const auto x = tpnorm_test::normal(11, 0, rows * h, 2.0, 1.5);
  const auto dy = tpnorm_test::normal(11, 1, rows * h);
  const auto gamma = tpnorm_test::normal(11, 2, h, 1.0, 0.3);
  const auto beta = tpnorm_test::normal(11, 3, h);
  for (bool centered : {true, false}) {
    const auto b = centered ? beta : std::vector<float>{};
    const Out o = run_rows(centered, x, rows, h, gamma, b, dy);
    const auto ref = tpnorm_test::row_norm_reference(centered, x, rows, h, gamma, b, 1e-5, dy);
    EXPECT_EQ(count_wrong("y", o.y, ref.y, 1e-5, 1e-5), 0);
    EXPECT_EQ(count_wrong("dx", o.dx, ref.dx, 1e-5, 1e-4), 0);
    EXPECT_EQ(count_wrong("dgamma", o.dgamma, ref.dgamma, 1e-5 * rows, 1e-5), 0);
  }
}
