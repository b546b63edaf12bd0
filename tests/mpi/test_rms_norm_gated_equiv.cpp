// Multi-rank gated RMSNorm (tpnorm/rms_norm_gated.h) with the channel dim sharded, under
// mpiexec at 2, 3, 4: groups inside one rank's slice, groups spanning ranks and straddling a
// boundary, uneven slices, a rank with no channel, both gate orders, fp16/bf16 with float32
// weights. Each rank's y, dx, dz, dweight and every group's rstd must match the float64
// reference on the unsharded data element by element; tolerances as
// tests/unit/test_rms_norm_gated (r = 1e-5 fp32, 1e-3 fp16, 8e-3 bf16: y r + r, rstd 1e-6 rel,
// dx and dz r*max(1, rstd) + 10 r, dweight r * rows + r). Stats::kExact must give the bits of a
// single-process call on the whole rows, at every world size.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "gated_reference.h"
#include "harness.h"
#include "storage.h"
#include "tpnorm/error.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

enum class SplitKind { kEven, kUneven, kZeroOnRank1 };

struct Case {
  const char* name;
  int64_t rows, hidden, group_size;
  bool norm_before_gate, gated;
  SplitKind split;
  DType dt, param;
  Stats stats;
};

Split channel_split(const Case& k, int P) {
  std::vector<int> w(P, 1);
  if (k.split == SplitKind::kUneven)
    for (int p = 0; p < P; ++p) w[p] = p + 1;
  if (k.split == SplitKind::kZeroOnRank1) w[1] = 0;
  return split_weighted(k.hidden, w);
}

GatedSetup setup(const Case& k, int64_t c_local, int64_t c0) {
  GatedSetup st;
  st.dt = k.dt;
  st.param = k.param;
  st.rows = k.rows;
  st.c_local = c_local;
  st.gg = {k.group_size, k.hidden, c0, k.norm_before_gate};
  st.gated = k.gated;
  st.opt.stats = k.stats;
  return st;
}

class RmsNormGatedEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(RmsNormGatedEquivalence, MatchesUnshardedReference) {
  const Case k = GetParam();
  const int P = world_size(), me = world_rank();
  const Split sp = channel_split(k, P);
  const int64_t c0 = sp.offset[me], nc = sp.count[me], groups = k.hidden / k.group_size;
  auto round = [&](DType t, std::vector<float> v) { return Buffer(t, v).floats(); };
  const auto x = round(k.dt, normal(93, 0, k.rows * k.hidden, 0.2, 1.5));
  const auto z =
      k.gated ? round(k.dt, normal(93, 1, k.rows * k.hidden, 0.0, 2.0)) : std::vector<float>{};
  const auto dy = round(k.dt, normal(93, 2, k.rows * k.hidden));
  const auto w = round(k.param, normal(93, 3, k.hidden, 1.0, 0.5));
  auto cols = [&](const std::vector<float>& m) {
    return m.empty() ? m : columns(m, k.rows, k.hidden, c0, nc);
  };

  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  world->set_strict_calls(0);
  world->reset_counters();
  const GatedOut got = run_gated(*world, setup(k, nc, c0), cols(x), cols(z),
                                 columns(w, 1, k.hidden, c0, nc), cols(dy));
  // One collective per call carrying every (row, group): rows * G values + a 10-value header,
  // float64 (robust), float32 (naive) or int64 limbs (exact: 8 per slot forward, 6 backward).
  EXPECT_EQ(world->counters().calls, 2u);
  // At P > 1 the slice table follows: 2 values per rank.
  const uint64_t slots = k.rows * groups;
  const uint64_t h = 10 + (world->size() > 1 ? 2u * static_cast<uint64_t>(world->size()) : 0);
  const uint64_t want_bytes = k.stats == Stats::kExact ? (slots * 8 + h) * 8 + (slots * 6 + h) * 8
                              : k.stats == Stats::kNaive ? 2 * (slots + h) * 4
                                                         : 2 * (slots + h) * 8;
  EXPECT_EQ(world->counters().bytes_sent, want_bytes);

  const GatedRef ref = rms_norm_gated_reference(x, z, k.rows, k.hidden, k.group_size,
                                                k.norm_before_gate, w, 1e-5, dy);
  auto ref_cols = [&](const std::vector<double>& m, int64_t rows) {
    std::vector<double> out;
    for (int64_t r = 0; r < rows; ++r)
      out.insert(out.end(), m.begin() + r * k.hidden + c0, m.begin() + r * k.hidden + c0 + nc);
    return out;
  };
  const double rt = storage_rtol(k.dt), rw = storage_rtol(k.param);
  const double rs = *std::max_element(ref.rstd.begin(), ref.rstd.end());
  reset_max_abs_err();
  int64_t wrong = 0;
  wrong += count_wrong("y", got.y, ref_cols(ref.y, k.rows), rt, rt);
  wrong += count_wrong("rstd", got.rstd, ref.rstd, 0, 1e-6);
  wrong += count_wrong("dx", got.dx, ref_cols(ref.dx, k.rows), rt * std::max(1.0, rs), 10 * rt);
  if (k.gated)
    wrong += count_wrong("dz", got.dz, ref_cols(ref.dz, k.rows), rt * std::max(1.0, rs), 10 * rt);
  wrong += count_wrong("dweight", got.dweight, ref_cols(ref.dweight, 1), rw * k.rows, rw);
  EXPECT_EQ(sum_over_ranks(wrong), 0) << "elements out of tolerance, summed over " << P << " ranks";
  const double worst = max_over_ranks(max_abs_err());
  if (me == 0) std::printf("largest |got - want| over ranks: %.3g\n", worst);

  if (k.stats != Stats::kExact) return;
  // Stats::kExact: the bits of one process holding the whole rows.
  auto single = make_single_communicator();
  const GatedOut one = run_gated(*single, setup(k, k.hidden, 0), x, z, w, dy);
  auto same_bits = [&](const char* what, const std::vector<float>& a, const std::vector<float>& b) {
    const bool same = a.size() == b.size() && std::memcmp(a.data(), b.data(), 4 * a.size()) == 0;
    EXPECT_TRUE(same) << what << " differs from the single-process call on rank " << me;
    return same ? 0 : 1;
  };
  int diff = same_bits("y", got.y, cols(one.y)) + same_bits("rstd", got.rstd, one.rstd) +
             same_bits("dx", got.dx, cols(one.dx)) +
             same_bits("dweight", got.dweight, columns(one.dweight, 1, k.hidden, c0, nc));
  if (k.gated) diff += same_bits("dz", got.dz, cols(one.dz));
  EXPECT_EQ(sum_over_ranks(diff), 0);
}

INSTANTIATE_TEST_SUITE_P(
    All, RmsNormGatedEquivalence,
    ::testing::Values(
        // n_groups = 1: the whole row is one group spanning every rank.
        Case{"one_group_gate_first", 3, 24, 24, false, true, SplitKind::kEven, DType::F32,
             DType::F32, Stats::kRobust},
        Case{"one_group_norm_first", 3, 24, 24, true, true, SplitKind::kEven, DType::F32,
             DType::F32, Stats::kRobust},
        // groups of 12 of 24: inside one rank at P = 2, straddling boundaries at P = 3, 4.
        Case{"G2_straddle", 4, 24, 12, false, true, SplitKind::kEven, DType::F32, DType::F32,
             Stats::kRobust},
        // groups of 2 of 24: inside a rank's slice at every P (no statistic crosses ranks).
        Case{"G12_local", 2, 24, 2, true, true, SplitKind::kEven, DType::F32, DType::F32,
             Stats::kRobust},
        Case{"G3_uneven", 3, 21, 7, false, true, SplitKind::kUneven, DType::F32, DType::F32,
             Stats::kRobust},
        Case{"G2_zero_on_rank1", 3, 16, 8, true, true, SplitKind::kZeroOnRank1, DType::F32,
             DType::F32, Stats::kRobust},
        Case{"G4_no_gate", 2, 16, 4, false, false, SplitKind::kUneven, DType::F32, DType::F32,
             Stats::kRobust},
        Case{"G2_naive", 3, 16, 8, false, true, SplitKind::kEven, DType::F32, DType::F32,
             Stats::kNaive},
        Case{"G3_bf16_fp32_weight", 3, 24, 8, false, true, SplitKind::kUneven, DType::BF16,
             DType::F32, Stats::kRobust},
        Case{"G1_fp16", 2, 20, 20, true, true, SplitKind::kEven, DType::F16, DType::F16,
             Stats::kRobust},
        Case{"G2_exact_gate_first", 3, 22, 11, false, true, SplitKind::kUneven, DType::F32,
             DType::F32, Stats::kExact},
        Case{"G1_exact_bf16_norm_first", 2, 20, 20, true, true, SplitKind::kZeroOnRank1,
             DType::BF16, DType::F32, Stats::kExact}),
    [](const auto& i) { return std::string(i.param.name); });

// Channel slices that cannot tile [0, hidden) fail on every rank: a slice past the end on one
// rank (a local check), slices whose channel counts do not add up to hidden, or slices that
// overlap while their counts add up (both checked on the summed slice table, so every rank
// sees it).
TEST(RmsNormGatedAgreement, BadSlicesFailEveryRank) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  const int P = world_size(), me = world_rank();
  for (int variant = 0; variant < 3; ++variant) {
    if (variant == 2 && P == 1) continue;  // one rank cannot overlap itself
    GatedSetup st;
    st.rows = 2;
    st.c_local = variant == 1 && me == 0 ? 0 : 1;  // variant 1: P - 1 channels of P
    // variant 0: rank 0 past the end; variant 2: every rank at offset 0 (the counts add up to
    // hidden, the slices overlap)
    st.gg = {P, P, variant == 0 && me == 0 ? P : variant == 2 ? 0 : me, false};
    st.backward = false;
    std::string msg;
    try {
      run_gated(*world, st, normal(3, me, 2 * st.c_local), normal(4, me, 2 * st.c_local),
                std::vector<float>(st.c_local, 1.0f), {});
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

// Ranks that disagree on the grouping or the gate order fail together, naming the field.
TEST(RmsNormGatedAgreement, DisagreementFailsEveryRank) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  const int P = world_size(), me = world_rank();
  GatedSetup st;
  st.rows = 2;
  st.c_local = 2;
  st.gg = {2, 2 * P, 2 * me, me == P - 1};
  st.backward = false;
  std::string msg;
  try {
    run_gated(*world, st, normal(5, me, 4), normal(6, me, 4), {1, 1}, {});
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_EQ(sum_over_ranks(msg.empty() ? 1 : 0), 0) << "a rank did not fail";
  EXPECT_NE(msg.find("norm_before_gate"), std::string::npos) << msg;
}

}  // namespace
