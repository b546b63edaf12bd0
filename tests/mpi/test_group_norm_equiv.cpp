// Multi-rank GroupNorm / InstanceNorm with channels sharded (tpnorm/group_norm.h) under
// mpiexec at 2, 3, 4: groups spanning ranks, channel counts not divisible by P, a rank with no
// channel, one sample. Each rank's y, dx, dgamma, dbeta and every group's mean / rstd must match
// the float64 reference on the full data. Tolerances as tests/unit/test_group_norm.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "group_reference.h"
#include "harness.h"
#include "storage.h"
#include "tpnorm/error.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

enum class SplitKind { kEven, kZeroOnRank1, kAllOnLast };

struct Case {
  const char* name;
  int64_t n, c, s, groups;  // groups 0: InstanceNorm
  SplitKind split;
  DType dt;
  double offset;
};

Split channel_split(const Case& k, int P) {
  std::vector<int> w(P, 1);
  if (k.split == SplitKind::kZeroOnRank1) w[1] = 0;
  if (k.split == SplitKind::kAllOnLast) std::fill(w.begin(), w.end() - 1, 0);
  return split_weighted(k.c, w);
}

class GroupNormEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(GroupNormEquivalence, MatchesUnshardedReference) {
  const Case k = GetParam();
  const int P = world_size(), me = world_rank();
  const Split sp = channel_split(k, P);
  const int64_t c0 = sp.offset[me], nc = sp.count[me];
  const bool instance = k.groups == 0;
  const int64_t groups = instance ? k.c : k.groups;
  auto round = [&](std::vector<float> v) { return Buffer(k.dt, v).floats(); };
  const auto x = round(normal(91, 0, k.n * k.c * k.s, k.offset, 1.5));
  const auto dy = round(normal(91, 1, k.n * k.c * k.s));
  const auto gamma = round(normal(91, 2, k.c, 1.0, 0.5)), beta = round(normal(91, 3, k.c));

  GroupSetup st;
  st.dt = k.dt;
  st.saved = k.offset != 0 ? DType::F64 : DType::F32;
  st.n = k.n;
  st.c_local = nc;
  st.s = k.s;
  st.cg = {groups, k.c, c0};
  st.affine = true;
  st.instance = instance;
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  world->set_strict_calls(0);
  world->reset_counters();
  const GroupOut got = run_group(
      *world, st, channel_slice(x, k.n, k.c, k.s, c0, nc), channel_slice(gamma, 1, k.c, 1, c0, nc),
      channel_slice(beta, 1, k.c, 1, c0, nc), channel_slice(dy, k.n, k.c, k.s, c0, nc));
  // One collective per call carrying every (sample, group): 2*N*G + 10 float64 values, and
  // at P > 1 the slice table (2 values per rank).
  const uint64_t table = world->size() > 1 ? 2u * static_cast<uint64_t>(world->size()) : 0;
  EXPECT_EQ(world->counters().calls, 2u);
  EXPECT_EQ(world->counters().bytes_sent, 2u * (2 * k.n * groups + 10 + table) * 8);

  const GroupRef ref = group_norm_reference(x, k.n, k.c, k.s, groups, gamma, beta, 1e-5, dy);
  const double rt = storage_rtol(k.dt);
  const double rs = *std::max_element(ref.rstd.begin(), ref.rstd.end());
  reset_max_abs_err();
  int64_t wrong = 0;
  wrong += count_wrong("y", got.y, channel_slice(ref.y, k.n, k.c, k.s, c0, nc), rt, rt);
  wrong += count_wrong("mean", got.mean, ref.mean, 1e-6, 1e-6);
  wrong += count_wrong("rstd", got.rstd, ref.rstd, 0, 1e-6);
  wrong += count_wrong("dx", got.dx, channel_slice(ref.dx, k.n, k.c, k.s, c0, nc),
                       rt * std::max(1.0, rs), 10 * rt);
  wrong += count_wrong("dgamma", got.dgamma, channel_slice(ref.dgamma, 1, k.c, 1, c0, nc),
                       rt * k.n * k.s, rt);
  wrong += count_wrong("dbeta", got.dbeta, channel_slice(ref.dbeta, 1, k.c, 1, c0, nc),
                       rt * k.n * k.s, rt);
  EXPECT_EQ(sum_over_ranks(wrong), 0) << "elements out of tolerance, summed over " << P << " ranks";
  const double worst = max_over_ranks(max_abs_err());
  if (me == 0) std::printf("largest |got - want| over ranks: %.3g\n", worst);
}

INSTANTIATE_TEST_SUITE_P(
    All, GroupNormEquivalence,
    ::testing::Values(
        Case{"G3_C6_even", 2, 6, 9, 3, SplitKind::kEven, DType::F32, 0.0},  // groups span ranks
        Case{"G2_C8_one_sample", 1, 8, 25, 2, SplitKind::kEven, DType::F32, 0.0},
        Case{"G1_C5_zero_on_rank1", 3, 5, 7, 1, SplitKind::kZeroOnRank1, DType::F32, 0.0},
        Case{"G2_C3_all_on_last_no_spatial", 4, 4, 1, 2, SplitKind::kAllOnLast, DType::F32, 0.0},
        Case{"G1_C3_even", 2, 3, 11, 1, SplitKind::kEven, DType::F32, 0.0},  // 4 ranks: one empty
        Case{"Instance_C5_even", 2, 5, 16, 0, SplitKind::kEven, DType::F32, 0.0},
        Case{"G3_C6_bf16", 2, 6, 9, 3, SplitKind::kEven, DType::BF16, 0.0},
        Case{"G2_C4_offset1e4", 2, 4, 64, 2, SplitKind::kEven, DType::F32, 1e4}),
    [](const auto& i) { return std::string(i.param.name); });

// Channel slices that cannot tile [0, C) fail on every rank: a slice past the end on one rank
// (a local check), slices whose channel counts do not add up to C, or slices that overlap
// while their counts add up (both checked on the summed slice table, so every rank sees it).
TEST(GroupNormAgreement, BadSlicesFailEveryRank) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  const int P = world_size(), me = world_rank();
  for (int variant = 0; variant < 3; ++variant) {
    if (variant == 2 && P == 1) continue;  // one rank cannot overlap itself
    GroupSetup st;
    st.n = 1;
    st.c_local = variant == 1 && me == 0 ? 0 : 1;  // variant 1: P - 1 channels of P
    st.s = 4;
    // variant 0: rank 0 past the end; variant 2: every rank at offset 0 (the counts add up to
    // C, the slices overlap)
    st.cg = {1, P, variant == 0 && me == 0 ? P : variant == 2 ? 0 : me};
    st.backward = false;
    std::string msg;
    try {
      run_group(*world, st, normal(3, me, st.c_local * st.s), {}, {}, {});
    } catch (const Error& e) {
      msg = e.what();
    }
    EXPECT_EQ(sum_over_ranks(msg.empty() ? 1 : 0), 0) << "a rank did not fail";
    const char* want = variant == 0   ? "offset"
                       : variant == 1 ? (P == 1 ? "channel slices hold" : "are held by no rank")
                                      : "is held by more than one rank";
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
  }
}

}  // namespace
