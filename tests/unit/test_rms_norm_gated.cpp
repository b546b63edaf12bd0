// Single-process gated RMSNorm (tpnorm/rms_norm_gated.h) against a worked example and the
// float64 reference: both gate orders, no gate, several group sizes, fp32/fp16/bf16/fp64
// storage, float32 weights next to fp16/bf16 (mixed precision), every stats mode, and the
// failure rules. Tolerances, r = one rounding of the storage dtype (fp32 1e-5, fp16 1e-3,
// bf16 8e-3): y r + r; rstd 1e-6 rel (fp32 saved); dx, dz r*max(1, rstd) + 10 r; dweight (a sum
// over rows) r * rows + r.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>

#include "expect_error.h"
#include "gated_reference.h"
#include "harness.h"
#include "storage.h"
#include "tpnorm/error.h"
#include "tpnorm/rms_norm_gated.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

TEST(RmsNormGated, WorkedExample) {
  // [1, 4] in groups of 2, no gate, no weight: {1, 2} has mean square 2.5, {3, 4} 12.5.
  GatedSetup st;
  st.rows = 1;
  st.c_local = 4;
  st.gg.group_size = 2;
  st.gated = st.weighted = st.backward = false;
  auto comm = make_single_communicator();
  const GatedOut o = run_gated(*comm, st, {1, 2, 3, 4}, {}, {}, {});
  const double want[4] = {1 / std::sqrt(2.5), 2 / std::sqrt(2.5), 3 / std::sqrt(12.5),
                          4 / std::sqrt(12.5)};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(o.y[i], want[i], 1e-5) << i;
  // The gate first: x * silu(z) with z = 0 is 0, so y is 0 wherever z is 0.
  st.gated = true;
  const GatedOut g = run_gated(*comm, st, {1, 2, 3, 4}, {0, 0, 1, 1}, {}, {});
  EXPECT_EQ(g.y[0], 0.0f);
  EXPECT_EQ(g.y[1], 0.0f);
  EXPECT_NEAR(g.y[2], 3 / std::sqrt(12.5), 1e-5);  // silu(1) scales both channels alike
}

// rows, hidden, group_size (-1: all), norm_before_gate, gated, storage, weight dtype, stats
using Param = std::tuple<int, int, int, bool, bool, DType, DType, Stats>;
class RmsNormGatedVsReference : public ::testing::TestWithParam<Param> {};

TEST_P(RmsNormGatedVsReference, ForwardAndBackward) {
  const auto [rows, hidden, gs, nbg, gated, dt, pdt, stats] = GetParam();
  auto round = [&](DType t, std::vector<float> v) { return Buffer(t, v).floats(); };
  const auto x = round(dt, normal(71, 0, rows * hidden, 0.3, 1.5));
  const auto z = gated ? round(dt, normal(71, 1, rows * hidden, 0.0, 2.0)) : std::vector<float>{};
  const auto dy = round(dt, normal(71, 2, rows * hidden));
  const auto w = round(pdt, normal(71, 3, hidden, 1.0, 0.5));
  GatedSetup st;
  st.dt = dt;
  st.param = pdt;
  st.rows = rows;
  st.c_local = hidden;
  st.gg.group_size = gs;
  st.gg.norm_before_gate = nbg;
  st.gated = gated;
  st.opt.stats = stats;
  auto comm = make_single_communicator();
  const GatedOut o = run_gated(*comm, st, x, z, w, dy);
  const GatedRef ref =
      rms_norm_gated_reference(x, z, rows, hidden, gs < 0 ? hidden : gs, nbg, w, 1e-5, dy);
  const double rt = storage_rtol(dt);
  const double rs = *std::max_element(ref.rstd.begin(), ref.rstd.end());
  EXPECT_EQ(count_wrong("y", o.y, ref.y, rt, rt), 0);
  EXPECT_EQ(count_wrong("rstd", o.rstd, ref.rstd, 0, 1e-6), 0);
  EXPECT_EQ(count_wrong("dx", o.dx, ref.dx, rt * std::max(1.0, rs), 10 * rt), 0);
  if (gated) {
    EXPECT_EQ(count_wrong("dz", o.dz, ref.dz, rt * std::max(1.0, rs), 10 * rt), 0);
  }
  const double rw = storage_rtol(pdt);
  EXPECT_EQ(count_wrong("dweight", o.dweight, ref.dweight, rw * rows, rw), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RmsNormGatedVsReference,
    ::testing::Values(Param{5, 12, 4, false, true, DType::F32, DType::F32, Stats::kRobust},
                      Param{5, 12, 4, true, true, DType::F32, DType::F32, Stats::kRobust},
                      Param{3, 16, -1, false, true, DType::F32, DType::F32, Stats::kRobust},
                      Param{3, 16, 1, true, true, DType::F32, DType::F32, Stats::kRobust},
                      Param{4, 10, 5, false, false, DType::F32, DType::F32, Stats::kRobust},
                      Param{4, 24, 8, false, true, DType::F32, DType::F32, Stats::kNaive},
                      Param{4, 24, 8, true, true, DType::F32, DType::F32, Stats::kExact},
                      Param{4, 24, 6, false, true, DType::F16, DType::F16, Stats::kRobust},
                      Param{4, 24, 6, true, true, DType::BF16, DType::BF16, Stats::kExact},
                      Param{4, 24, 12, false, true, DType::BF16, DType::F32, Stats::kRobust},
                      Param{4, 24, 12, true, true, DType::F16, DType::F32, Stats::kExact},
                      Param{3, 20, 10, false, true, DType::F64, DType::F64, Stats::kRobust}),
    [](const auto& i) {
      const auto& p = i.param;
      const int gs = std::get<2>(p);
      return "R" + std::to_string(std::get<0>(p)) + "_H" + std::to_string(std::get<1>(p)) + "_G" +
             (gs < 0 ? std::string("all") : std::to_string(gs)) +
             (std::get<4>(p) ? (std::get<3>(p) ? "_norm_first_" : "_gate_first_") : "_no_gate_") +
             dtype_name(std::get<5>(p)) + "_w" + dtype_name(std::get<6>(p)) + "_s" +
             std::to_string(static_cast<int>(std::get<7>(p)));
    });

// Bad arguments throw kInvalidArgument and leave the outputs untouched.
TEST(RmsNormGated, BadArgumentsLeaveOutputsUntouched) {
  auto comm = make_single_communicator();
  std::vector<float> x(12, 1.0f), z(12, 1.0f), y(12, 7.0f), rstd(6, 7.0f), w(6, 1.0f);
  const Shape sh{2, 6};
  auto forward = [&](GatedGroups gg, TensorView wv, TensorView rv) {
    return error_of(
        [&] {
          rms_norm_gated_forward(*comm, view(x.data(), sh), view(z.data(), sh), gg, wv,
                                 view(y.data(), sh), rv);
        },
        ErrorCode::kInvalidArgument);
  };
  EXPECT_NE(forward({4, -1, 0, false}, {}, {}).find("does not divide"), std::string::npos);
  EXPECT_NE(forward({2, 6, 1, false}, {}, {}).find("offset"), std::string::npos);
  EXPECT_NE(forward({0, -1, 0, false}, {}, {}).find("group_size"), std::string::npos);
  EXPECT_NE(forward({2, -1, 0, false}, view(w.data(), {5}), {}).find("weight"), std::string::npos);
  EXPECT_NE(forward({2, -1, 0, false}, {}, view(rstd.data(), {5})).find("rstd"), std::string::npos);
  for (float v : y) EXPECT_EQ(v, 7.0f);
  for (float v : rstd) EXPECT_EQ(v, 7.0f);
  // The backward's gradient of z must be there exactly when z is.
  std::vector<float> dx(12, 7.0f), dz(12, 7.0f);
  const std::string msg = error_of(
      [&] {
        rms_norm_gated_backward(*comm, view(x.data(), sh), view(x.data(), sh), {},
                                {2, -1, 0, false}, {}, view(rstd.data(), {2, 3}),
                                view(dx.data(), sh), view(dz.data(), sh), {});
      },
      ErrorCode::kInvalidArgument);
  EXPECT_NE(msg.find("dz"), std::string::npos) << msg;
  for (float v : dx) EXPECT_EQ(v, 7.0f);
}

}  // namespace
