// Single-process GroupNorm / InstanceNorm (tpnorm/group_norm.h) against a worked example, the
// float64 reference and central finite differences. Tolerances, r = one rounding of the storage
// dtype (fp32 1e-5, fp16 1e-3, bf16 8e-3): y r + r; mean/rstd 1e-6 rel; dx r*max(1, rstd) +
// 10 r; dgamma, dbeta (sums over N*S elements): r * N * S + r.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "group_reference.h"
#include "harness.h"
#include "storage.h"
#include "tpnorm/error.h"
#include "tpnorm/group_norm.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

TEST(GroupNorm, WorkedExample) {
  // [1, 4 channels, 2] in 2 groups: each group {1,2,3,4}+k normalizes to +-1.342, +-0.447.
  const std::vector<float> x = {1, 2, 3, 4, 11, 12, 13, 14};
  GroupSetup st;
  st.n = 1;
  st.c_local = 4;
  st.s = 2;
  st.cg.groups = 2;
  st.backward = false;
  auto comm = make_single_communicator();
  const GroupOut o = run_group(*comm, st, x, {}, {}, {});
  const double want[4] = {-1.342, -0.447, 0.447, 1.342};
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(o.y[i], want[i % 4], 1e-3) << i;
  EXPECT_FLOAT_EQ(o.mean[0], 2.5f);
  EXPECT_FLOAT_EQ(o.mean[1], 12.5f);
}

using Param = std::tuple<int, int, int, int, bool, DType>;  // N, C, S, G (0: instance), affine
class GroupNormVsReference : public ::testing::TestWithParam<Param> {};

TEST_P(GroupNormVsReference, ForwardAndBackward) {
  const auto [n, c, s, g0, affine, dt] = GetParam();
  const bool instance = g0 == 0;
  const int64_t groups = instance ? c : g0;
  auto round = [&](std::vector<float> v) { return Buffer(dt, v).floats(); };
  const auto x = round(normal(61, 0, n * c * s, 0.5, 2.0));
  const auto dy = round(normal(61, 1, n * c * s));
  const auto gamma = affine ? round(normal(61, 2, c, 1.0, 0.5)) : std::vector<float>{};
  const auto beta = affine ? round(normal(61, 3, c)) : std::vector<float>{};
  GroupSetup st;
  st.dt = dt;
  st.n = n;
  st.c_local = c;
  st.s = s;
  st.cg.groups = groups;
  st.affine = affine;
  st.instance = instance;
  auto comm = make_single_communicator();
  const GroupOut o = run_group(*comm, st, x, gamma, beta, dy);
  const GroupRef ref = group_norm_reference(x, n, c, s, groups, gamma, beta, 1e-5, dy);
  const double rt = storage_rtol(dt);
  const double rs = *std::max_element(ref.rstd.begin(), ref.rstd.end());
  EXPECT_EQ(count_wrong("y", o.y, ref.y, rt, rt), 0);
  EXPECT_EQ(count_wrong("mean", o.mean, ref.mean, 1e-6, 1e-6), 0);
  EXPECT_EQ(count_wrong("rstd", o.rstd, ref.rstd, 0, 1e-6), 0);
  EXPECT_EQ(count_wrong("dx", o.dx, ref.dx, rt * std::max(1.0, rs), 10 * rt), 0);
  EXPECT_EQ(count_wrong("dgamma", o.dgamma, ref.dgamma, rt * n * s, rt), 0);
  EXPECT_EQ(count_wrong("dbeta", o.dbeta, ref.dbeta, rt * n * s, rt), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GroupNormVsReference,
    ::testing::Values(Param{2, 6, 49, 3, true, DType::F32}, Param{1, 8, 1, 2, true, DType::F32},
                      Param{3, 4, 17, 1, false, DType::F32}, Param{2, 5, 33, 0, true, DType::F32},
                      Param{4, 32, 64, 8, true, DType::F32}, Param{2, 6, 49, 3, true, DType::F16},
                      Param{2, 6, 49, 2, true, DType::BF16}),
    [](const auto& i) {
      const auto& p = i.param;
      return (std::get<3>(p) == 0 ? std::string("Instance_")
                                  : "G" + std::to_string(std::get<3>(p)) + "_") +
             "N" + std::to_string(std::get<0>(p)) + "C" + std::to_string(std::get<1>(p)) + "S" +
             std::to_string(std::get<2>(p)) + (std::get<4>(p) ? "_affine_" : "_plain_") +
             dtype_name(std::get<5>(p));
    });

// loss = sum(y * w); its gradients by central differences of the op itself.
TEST(GroupNorm, FiniteDifferenceGradients) {
  for (bool instance : {false, true}) {
    const int64_t n = 2, c = 4, s = 3;
    auto x = normal(71, 0, n * c * s, 0.3, 1.0);
    auto gamma = normal(71, 1, c, 1.0, 0.3), beta = normal(71, 2, c);
    const auto w = normal(71, 3, n * c * s);
    GroupSetup st;
    st.saved = DType::F64;
    st.n = n;
    st.c_local = c;
    st.s = s;
    st.cg.groups = 2;
    st.affine = true;
    st.instance = instance;
    auto comm = make_single_communicator();
    const GroupOut o = run_group(*comm, st, x, gamma, beta, w);
    GroupSetup fwd = st;
    fwd.backward = false;
    auto fd = [&](std::vector<float>& v, size_t i) {
      auto loss = [&] {
        const GroupOut q = run_group(*comm, fwd, x, gamma, beta, {});
        double l = 0;
        for (size_t k = 0; k < q.y.size(); ++k) l += double(q.y[k]) * w[k];
        return l;
      };
      const float keep = v[i], step = 1e-2f;
      v[i] = keep + step;
      const double lp = loss();
      v[i] = keep - step;
      const double lm = loss();
      v[i] = keep;
      return (lp - lm) / (2.0 * step);
    };
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(o.dx[i], fd(x, i), 3e-3) << "dx " << i;
    for (int64_t k = 0; k < c; ++k) EXPECT_NEAR(o.dgamma[k], fd(gamma, k), 3e-3) << "dgamma " << k;
    for (int64_t k = 0; k < c; ++k) EXPECT_NEAR(o.dbeta[k], fd(beta, k), 3e-3) << "dbeta " << k;
  }
}

// 1e4 + N(0,1) per group: the robust default keeps the variance.
TEST(GroupNorm, LargeOffset) {
  const int64_t n = 2, c = 4, s = 1024;
  const auto x = normal(81, 0, n * c * s, 1e4, 1.0);
  GroupSetup st;
  st.n = n;
  st.c_local = c;
  st.s = s;
  st.cg.groups = 2;
  st.backward = false;
  auto comm = make_single_communicator();
  const GroupOut o = run_group(*comm, st, x, {}, {}, {});
  const GroupRef ref = group_norm_reference(x, n, c, s, 2, {}, {}, 1e-5);
  EXPECT_EQ(count_wrong("y", o.y, ref.y, 1e-4, 1e-4), 0);
  EXPECT_EQ(count_wrong("rstd", o.rstd, ref.rstd, 0, 1e-5), 0);
}

TEST(GroupNorm, GroupsMustDivideChannels) {
  GroupSetup st;
  st.n = 1;
  st.c_local = 6;
  st.s = 2;
  st.cg.groups = 4;
  st.backward = false;
  auto comm = make_single_communicator();
  const std::vector<float> x(12, 1.f);
  try {
    run_group(*comm, st, x, {}, {}, {});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not divide"), std::string::npos) << e.what();
  }
}

}  // namespace
