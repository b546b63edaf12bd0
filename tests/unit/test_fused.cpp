// Single-process fused residual add + LayerNorm / RMSNorm (tpnorm/fused.h) against the float64
// reference (fused_reference.h) and central finite differences of the op itself.
// Tolerances, with r = one rounding of the storage dtype (fp32 1e-5, fp16 1e-3, bf16 8e-3):
//   h: r abs + r rel;  y: r + r;  rstd/mean: 1e-6 rel (fp32 statistics; the reference normalizes
//   the op's stored h, so the statistics see the same inputs);  dx, df: r*max(1, rstd)*alpha
//   abs + 10 r rel;  dgamma, dbeta: r * rows + r.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "fused_reference.h"
#include "harness.h"
#include "storage.h"
#include "tpnorm/fused.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

std::vector<float> rounded(DType dt, const std::vector<float>& v) { return Buffer(dt, v).floats(); }

// DeepNet's presets (Wang et al. 2022, table 1), with layer counts chosen so that the values
// are exact by hand: N encoder layers, M decoder layers.
TEST(Fused, DeepNormPresets) {
  using S = DeepNormStack;
  EXPECT_NEAR(deepnorm_alpha(S::kEncoderOnly, 8, 0), 2.0, 1e-15);                  // (2*8)^(1/4)
  EXPECT_NEAR(deepnorm_alpha(S::kEncoderOnly, 100, 0), 3.760603093086394, 1e-12);  // 200^(1/4)
  EXPECT_NEAR(deepnorm_alpha(S::kDecoderOnly, 0, 8), 2.0, 1e-15);                  // (2*8)^(1/4)
  EXPECT_NEAR(deepnorm_alpha(S::kDecoderOnly, 0, 18), 2.449489742783178, 1e-12);   // 36^(1/4)
  // 0.81 (N^4 M)^(1/16) with N = 2, M = 16: 0.81 * 256^(1/16) = 0.81 * sqrt(2)
  EXPECT_NEAR(deepnorm_alpha(S::kEncoderOfEncoderDecoder, 2, 16), 1.1455129855222068, 1e-12);
  EXPECT_NEAR(deepnorm_alpha(S::kDecoderOfEncoderDecoder, 2, 27), 3.0, 1e-15);  // (3*27)^(1/4)

  EXPECT_NEAR(deepnorm_beta(S::kEncoderOnly, 2, 0), 0.5, 1e-15);    // (8*2)^(-1/4)
  EXPECT_NEAR(deepnorm_beta(S::kDecoderOnly, 0, 32), 0.25, 1e-15);  // (8*32)^(-1/4)
  // 0.87 (N^4 M)^(-1/16) with N = 2, M = 16: 0.87 / sqrt(2)
  EXPECT_NEAR(deepnorm_beta(S::kEncoderOfEncoderDecoder, 2, 16), 0.6151828996322963, 1e-12);
  EXPECT_NEAR(deepnorm_beta(S::kDecoderOfEncoderDecoder, 2, 108), 1.0 / 6.0, 1e-15);  // 1296^(-1/4)

  // The count a preset does not use is ignored; the ones it uses must be >= 1.
  EXPECT_EQ(deepnorm_alpha(S::kEncoderOnly, 8, 0), deepnorm_alpha(S::kEncoderOnly, 8, 99));
  EXPECT_THROW(deepnorm_alpha(S::kEncoderOnly, 0, 8), Error);
  EXPECT_THROW(deepnorm_alpha(S::kDecoderOnly, 8, 0), Error);
  EXPECT_THROW(deepnorm_beta(S::kEncoderOfEncoderDecoder, 6, 0), Error);
  EXPECT_THROW(deepnorm_beta(S::kDecoderOfEncoderDecoder, 6, 0), Error);
  EXPECT_THROW(deepnorm_alpha(static_cast<S>(7), 6, 6), Error);
}

using Param = std::tuple<bool, int, int, double, bool, DType>;
class FusedVsReference : public ::testing::TestWithParam<Param> {};

TEST_P(FusedVsReference, ForwardAndBackward) {
  const auto [centered, rows, h, alpha, extra, dt] = GetParam();
  const auto x = rounded(dt, normal(11, 0, rows * h, 0.2, 1.5));
  const auto f = rounded(dt, normal(11, 1, rows * h, -0.1, 0.7));
  const auto dy = rounded(dt, normal(11, 2, rows * h));
  const auto dh = extra ? rounded(dt, normal(11, 3, rows * h)) : std::vector<float>{};
  const auto gamma = rounded(dt, normal(11, 4, h, 1.0, 0.5));
  const auto beta = centered ? rounded(dt, normal(11, 5, h)) : std::vector<float>{};
  auto comm = make_single_communicator();
  FusedSetup st;
  st.centered = centered;
  st.dt = dt;
  st.alpha = alpha;
  st.rows = rows;
  st.h = h;
  st.affine = st.backward = true;
  st.extra = extra;
  const FusedOut o = run_fused(*comm, st, x, f, gamma, beta, dy, dh);
  const FusedRef ref =
      fused_reference(centered, x, f, alpha, o.h, rows, h, gamma, beta, 1e-5, dy, dh);
  const double rt = storage_rtol(dt);
  const double rs = *std::max_element(ref.norm.rstd.begin(), ref.norm.rstd.end());
  EXPECT_EQ(count_wrong("h", o.h, ref.h, rt, rt), 0);
  EXPECT_EQ(count_wrong("y", o.y, ref.norm.y, rt, rt), 0);
  EXPECT_EQ(count_wrong("rstd", o.rstd, ref.norm.rstd, 0, 1e-6), 0);
  if (centered) {
    EXPECT_EQ(count_wrong("mean", o.mean, ref.norm.mean, 1e-6, 1e-6), 0);
  }
  const double gtol = rt * std::max(1.0, rs);
  EXPECT_EQ(count_wrong("df", o.df, ref.df, gtol, 10 * rt), 0);
  EXPECT_EQ(count_wrong("dx", o.dx, ref.dx, gtol * alpha, 10 * rt), 0);
  EXPECT_EQ(count_wrong("dgamma", o.dgamma, ref.norm.dgamma, rt * rows, rt), 0);
  if (centered) {
    EXPECT_EQ(count_wrong("dbeta", o.dbeta, ref.norm.dbeta, rt * rows, rt), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, FusedVsReference,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(1, 29),
                                            ::testing::Values(1, 229), ::testing::Values(1.0, 2.0),
                                            ::testing::Bool(),
                                            ::testing::Values(DType::F32, DType::F16, DType::BF16)),
                         [](const auto& i) {
                           return std::string(std::get<0>(i.param) ? "LayerNorm_" : "RMSNorm_") +
                                  std::to_string(std::get<1>(i.param)) + "x" +
                                  std::to_string(std::get<2>(i.param)) +
                                  (std::get<3>(i.param) == 1.0 ? "_alpha1" : "_alpha2") +
                                  (std::get<4>(i.param) ? "_dhextra_" : "_nodhextra_") +
                                  dtype_name(std::get<5>(i.param));
                         });

// loss = sum(y * w) + sum(h * v): its gradient is exactly what the backward returns with
// dy = w and dh_extra = v (dx = alpha * dh, df = dh), checked by central differences.
TEST(Fused, FiniteDifferenceGradients) {
  for (bool centered : {true, false}) {
    const int64_t rows = 3, h = 6;
    const double alpha = deepnorm_alpha(DeepNormStack::kEncoderOnly, 4, 0);
    auto x = normal(13, 0, rows * h, 0.4, 1.0);
    auto f = normal(13, 1, rows * h, 0.0, 0.8);
    const auto gamma = normal(13, 2, h, 1.0, 0.3);
    const auto beta = centered ? normal(13, 3, h) : std::vector<float>{};
    const auto w = normal(13, 4, rows * h), v = normal(13, 5, rows * h);
    auto comm = make_single_communicator();
    FusedSetup st;
    st.centered = centered;
    st.saved = DType::F64;
    st.alpha = alpha;
    st.rows = rows;
    st.h = h;
    st.affine = true;
    auto loss = [&] {
      const FusedOut o = run_fused(*comm, st, x, f, gamma, beta);
      double l = 0;
      for (size_t i = 0; i < o.y.size(); ++i) l += double(o.y[i]) * w[i] + double(o.h[i]) * v[i];
      return l;
    };
    FusedSetup grad = st;
    grad.backward = grad.extra = true;
    const FusedOut o = run_fused(*comm, grad, x, f, gamma, beta, w, v);
    auto fd = [&](std::vector<float>& a, size_t i) {
      const float keep = a[i], step = 1e-2f;
      a[i] = keep + step;
      const double lp = loss();
      a[i] = keep - step;
      const double lm = loss();
      a[i] = keep;
      return (lp - lm) / (2.0 * step);
    };
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(o.dx[i], fd(x, i), 3e-3) << "dx " << i;
    for (size_t i = 0; i < f.size(); ++i) EXPECT_NEAR(o.df[i], fd(f, i), 3e-3) << "df " << i;
  }
}

// h written over x (an in-place residual stream) gives the same results as a separate buffer.
TEST(Fused, InPlaceResidualMatches) {
  const int64_t rows = 5, h = 37;
  const auto x = normal(17, 0, rows * h), f = normal(17, 1, rows * h), dy = normal(17, 2, rows * h);
  auto comm = make_single_communicator();
  for (bool centered : {true, false}) {
    FusedSetup st;
    st.centered = centered;
    st.rows = rows;
    st.h = h;
    st.backward = true;
    const FusedOut a = run_fused(*comm, st, x, f, {}, {}, dy);
    st.in_place = true;
    const FusedOut b = run_fused(*comm, st, x, f, {}, {}, dy);
    EXPECT_EQ(a.h, b.h);
    EXPECT_EQ(a.y, b.y);
    EXPECT_EQ(a.dx, b.dx);
  }
}

// A bad df is reported as 'df' (the norm stage inside calls its output dx).
TEST(Fused, BadDfIsNamed) {
  auto comm = make_single_communicator();
  std::vector<float> h(12, 1.f), dy(12), dx(12), df(10), rstd(3), mean(3);
  const Shape s{3, 4}, r{3};
  try {
    fused_add_layer_norm_backward(*comm, view(dy.data(), s), {}, view(h.data(), s), {},
                                  view(mean.data(), r), view(rstd.data(), r), 1.0,
                                  view(dx.data(), s), view(df.data(), {2, 5}), {}, {});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'df' has shape [2, 5]"), std::string::npos) << e.what();
  }
}

}  // namespace
