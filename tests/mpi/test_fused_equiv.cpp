// Multi-rank fused residual add + LayerNorm / RMSNorm (tpnorm/fused.h) under mpiexec at 2, 3, 4.
//
// Every rank makes the full x, f, dy, dh_extra from a seed and keeps its columns; h, y, mean,
// rstd, dx, df, dgamma, dbeta must match, element by element, the float64 reference on the
// full data and the single-process op on the full input. Tolerances as tests/unit/test_fused,
// but for mean / rstd: row_stat_tolerance (tests/reference/reference.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "fused_reference.h"
#include "harness.h"
#include "storage.h"
#include "tpnorm/error.h"
#include "tpnorm/fused.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

struct Case {
  const char* name;
  int64_t rows, hidden;
  int zero_rank;  // a rank holding no column (-1: even split)
  double offset;
};

std::vector<double> cols(const std::vector<double>& m, int64_t rows, int64_t n, int64_t c0,
                         int64_t nc) {
  std::vector<double> out(static_cast<size_t>(rows * nc));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < nc; ++c) out[r * nc + c] = m[r * n + c0 + c];
  return out;
}
std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

using Param = std::tuple<Case, bool, double, DType>;
class FusedEquivalence : public ::testing::TestWithParam<Param> {};

TEST_P(FusedEquivalence, MatchesUnshardedReferenceAndSingleProcess) {
  const auto [c, centered, alpha, dt] = GetParam();
  const int P = world_size(), me = world_rank();
  std::vector<int> weights(P, 1);
  if (c.zero_rank >= 0 && c.zero_rank < P) weights[c.zero_rank] = 0;
  const Split sp = split_weighted(c.hidden, weights);
  const int64_t c0 = sp.offset[me], h = sp.count[me], R = c.rows, H = c.hidden;

  auto round = [&](std::vector<float> v) { return Buffer(dt, v).floats(); };
  const auto x = round(normal(21, 0, R * H, c.offset, 1.5));
  const auto f = round(normal(21, 1, R * H, 0.0, 0.5));
  const auto dy = round(normal(21, 2, R * H));
  const auto ex = round(normal(21, 3, R * H));
  const auto gamma = round(normal(21, 4, H, 1.0, 0.5));
  const auto beta = centered ? round(normal(21, 5, H)) : std::vector<float>{};
  auto mine = [&](const std::vector<float>& m, int64_t rows) { return columns(m, rows, H, c0, h); };
  const DType saved = c.offset != 0 ? DType::F64 : DType::F32;  // see test_row_norm_equiv

  FusedSetup st;
  st.centered = centered;
  st.dt = dt;
  st.saved = saved;
  st.alpha = alpha;
  st.rows = R;
  st.h = h;
  st.affine = st.backward = st.extra = true;
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  const FusedOut got =
      run_fused(*world, st, mine(x, R), mine(f, R), mine(gamma, 1),
                centered ? mine(beta, 1) : std::vector<float>{}, mine(dy, R), mine(ex, R));
  auto single = make_single_communicator();
  st.h = H;
  const FusedOut one = run_fused(*single, st, x, f, gamma, beta, dy, ex);
  // The reference normalizes the single-process op's h (the same element-wise kernel, so the
  // same values as the shards'); h itself is checked against float64 alpha*x + f.
  const FusedRef ref =
      fused_reference(centered, x, f, alpha, one.h, R, H, gamma, beta, 1e-5, dy, ex);

  const double rt = storage_rtol(dt);
  const double rs = *std::max_element(ref.norm.rstd.begin(), ref.norm.rstd.end());
  const double gtol = rt * std::max(1.0, rs);
  // Saved statistics: the row kernels' float32 block-sum bound (1e-6 unless a shard's first
  // element lies far from its row's mean; see tests/reference/reference.h).
  const RowStatTol stol = row_stat_tolerance(centered, one.h, R, H, sp.offset, sp.count, ref.norm);
  struct Check {
    const char* what;
    const std::vector<float>& got;
    std::vector<double> want;
    double atol, rtol;
  };
  std::vector<Check> checks = {
      {"h", got.h, cols(ref.h, R, H, c0, h), rt, rt},
      {"y", got.y, cols(ref.norm.y, R, H, c0, h), rt, rt},
      {"rstd", got.rstd, ref.norm.rstd, 0, stol.rstd_rtol},
      {"df", got.df, cols(ref.df, R, H, c0, h), gtol, 10 * rt},
      {"dx", got.dx, cols(ref.dx, R, H, c0, h), gtol * alpha, 10 * rt},
      {"dgamma", got.dgamma, cols(ref.norm.dgamma, 1, H, c0, h), rt * R, rt},
      {"y vs single", got.y, cols(to_double(one.y), R, H, c0, h), rt, rt},
      {"dx vs single", got.dx, cols(to_double(one.dx), R, H, c0, h), gtol * alpha, 10 * rt},
  };
  if (centered) {
    checks.push_back({"mean", got.mean, ref.norm.mean, stol.mean_atol, 1e-6});
    checks.push_back({"dbeta", got.dbeta, cols(ref.norm.dbeta, 1, H, c0, h), rt * R, rt});
  }
  reset_max_abs_err();
  int64_t wrong = 0;
  for (const Check& k : checks) wrong += count_wrong(k.what, k.got, k.want, k.atol, k.rtol);
  EXPECT_EQ(sum_over_ranks(wrong), 0) << "elements out of tolerance, summed over " << P << " ranks";
  const double worst = max_over_ranks(max_abs_err());
  if (me == 0) std::printf("largest |got - want| over ranks: %.3g\n", worst);
}

const Case kCases[] = {
    {"r16_h300_even", 16, 300, -1, 0.0},
    {"r1_h1031_even", 1, 1031, -1, 0.0},
    {"r7_h33_zero_on_rank1", 7, 33, 1, 0.0},
    {"r5_h3_even", 5, 3, -1, 0.0},  // at 4 ranks one rank has no column
    {"r4_h500_offset1e4", 4, 500, -1, 1e4},
};

INSTANTIATE_TEST_SUITE_P(
    All, FusedEquivalence,
    ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Bool(),
                       ::testing::Values(1.0, deepnorm_alpha(DeepNormStack::kDecoderOnly, 0, 48)),
                       ::testing::Values(DType::F32, DType::BF16)),
    [](const auto& i) {
      return std::string(std::get<1>(i.param) ? "LayerNorm_" : "RMSNorm_") +
             std::get<0>(i.param).name + (std::get<2>(i.param) == 1.0 ? "_alpha1_" : "_deep_") +
             dtype_name(std::get<3>(i.param));
    });

// Exactly one collective per forward and per backward, with the plain norm's payload.
TEST(FusedTraffic, OneCollectivePerCallWithDocumentedBytes) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  world->set_strict_calls(0);  // the fingerprint folded into the payload collective
  const int64_t R = 9, h = 4;
  const auto x = normal(5, world_rank(), R * h), f = normal(6, world_rank(), R * h);
  for (bool centered : {true, false}) {
    for (Stats mode : {Stats::kRobust, Stats::kNaive}) {
      FusedSetup st;
      st.centered = centered;
      st.alpha = 2.0;
      st.rows = R;
      st.h = h;
      st.backward = st.extra = true;
      st.opt.stats = mode;
      world->reset_counters();
      run_fused(*world, st, x, f, {}, {}, x, f);
      const uint64_t per_call = (R * (centered ? 2 : 1) + 10) * (mode == Stats::kRobust ? 8 : 4);
      EXPECT_EQ(world->counters().calls, 2u);
      EXPECT_EQ(world->counters().bytes_sent, 2 * per_call);
    }
  }
}

// Ranks that disagree on alpha fail together with a message naming it, in both agreement modes.
TEST(FusedAgreement, AlphaMismatchFailsEveryRank) {
  for (int64_t strict : {int64_t{-1}, int64_t{0}}) {
    auto world = make_mpi_communicator(MPI_COMM_WORLD);
    world->set_strict_calls(strict);
    const auto x = normal(7, world_rank(), 12);
    std::string msg;
    try {
      FusedSetup st;
      st.alpha = world_rank() == 0 ? 1.0 : 2.0;
      st.rows = 3;
      st.h = 4;
      run_fused(*world, st, x, x);
    } catch (const Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("'alpha'"), std::string::npos) << msg;
    EXPECT_EQ(sum_over_ranks(msg.empty() ? 1 : 0), 0);
  }
}

}  // namespace
