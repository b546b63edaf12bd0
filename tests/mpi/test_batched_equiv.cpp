// Multi-rank batched norms (tpnorm/batched.h) under mpiexec at 2, 3, 4: a q-norm, a k-norm
// and a pre-norm, each sharded differently (even, nothing on rank 1, everything on the last
// rank), in one call with ONE collective, each item matching the float64 reference on the full
// data. Tolerances as tests/unit/test_batched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "batched_runner.h"
#include "harness.h"
#include "reference.h"
#include "storage.h"
#include "tpnorm/batched.h"
#include "tpnorm/error.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

enum class SplitKind { kEven, kZeroOnRank1, kAllOnLast };

struct Spec {
  bool centered;
  DType dt;
  int64_t rows, hidden;
  bool affine;
  SplitKind split;
  double offset;
};

struct Full {
  std::vector<float> x, gamma, beta, dy;
};

Full make_full(const Spec& s, uint64_t seed) {
  auto round = [&](std::vector<float> v) { return Buffer(s.dt, v).floats(); };
  Full f{round(normal(seed, 0, s.rows * s.hidden, s.offset, 1.5)),
         {},
         {},
         round(normal(seed, 1, s.rows * s.hidden))};
  if (s.affine) {
    f.gamma = round(normal(seed, 2, s.hidden, 1.0, 0.5));
    if (s.centered) f.beta = round(normal(seed, 3, s.hidden));
  }
  return f;
}

Split split_of(const Spec& s, int P) {
  std::vector<int> w(P, 1);
  if (s.split == SplitKind::kZeroOnRank1) w[1] = 0;
  if (s.split == SplitKind::kAllOnLast) std::fill(w.begin(), w.end() - 1, 0);
  return split_weighted(s.hidden, w);
}

std::vector<double> cols(const std::vector<double>& m, int64_t rows, int64_t n, int64_t c0,
                         int64_t nc) {
  std::vector<double> out(static_cast<size_t>(rows * nc));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < nc; ++c) out[r * nc + c] = m[r * n + c0 + c];
  return out;
}

// This rank's slice of each item; also used for the single-process run with P = 1.
std::vector<BatchedItem> shard(const std::vector<Spec>& specs, const std::vector<Full>& full, int P,
                               int me, std::vector<Split>& splits) {
  std::vector<BatchedItem> items;
  splits.clear();
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& s = specs[i];
    splits.push_back(P == 1 ? split_even(s.hidden, 1) : split_of(s, P));
    const int64_t c0 = splits.back().offset[me], h = splits.back().count[me];
    BatchedItem it{s.centered,
                   s.dt,
                   s.offset != 0 ? DType::F64 : DType::F32,
                   s.rows,
                   h,
                   s.affine,
                   columns(full[i].x, s.rows, s.hidden, c0, h),
                   {},
                   {},
                   columns(full[i].dy, s.rows, s.hidden, c0, h)};
    if (s.affine) {
      it.gamma = columns(full[i].gamma, 1, s.hidden, c0, h);
      if (s.centered) it.beta = columns(full[i].beta, 1, s.hidden, c0, h);
    }
    items.push_back(it);
  }
  return items;
}

const std::vector<Spec> kSpecs = {
    {false, DType::F32, 32, 64, true, SplitKind::kEven, 0.0},         // q-norm
    {false, DType::BF16, 8, 64, true, SplitKind::kZeroOnRank1, 0.0},  // k-norm
    {true, DType::F32, 4, 1003, true, SplitKind::kEven, 0.0},         // pre-norm
    {true, DType::F16, 1, 33, false, SplitKind::kAllOnLast, 0.0},     // one row, no affine
    {true, DType::F32, 3, 5, true, SplitKind::kEven, 1e4},            // 1e4 + N(0,1)
};

TEST(BatchedEquivalence, EveryItemMatchesUnshardedReference) {
  const int P = world_size(), me = world_rank();
  std::vector<Full> full;
  for (size_t i = 0; i < kSpecs.size(); ++i) full.push_back(make_full(kSpecs[i], 31 + i));
  std::vector<Split> splits;
  const auto items = shard(kSpecs, full, P, me, splits);
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  world->set_strict_calls(0);
  world->reset_counters();
  const auto got = run_batched(*world, items);
  EXPECT_EQ(world->counters().calls, 2u) << "one collective per batched forward and backward";

  reset_max_abs_err();
  int64_t wrong = 0;
  for (size_t i = 0; i < kSpecs.size(); ++i) {
    const Spec& s = kSpecs[i];
    const int64_t c0 = splits[i].offset[me], h = splits[i].count[me], R = s.rows, H = s.hidden;
    const RowRef ref = row_norm_reference(s.centered, full[i].x, R, H, full[i].gamma, full[i].beta,
                                          1e-5, full[i].dy);
    const double rt = storage_rtol(s.dt);
    const double rs = *std::max_element(ref.rstd.begin(), ref.rstd.end());
    const std::string tag = "item " + std::to_string(i) + " ";
    wrong += count_wrong((tag + "y").c_str(), got[i].y, cols(ref.y, R, H, c0, h), rt, rt);
    wrong += count_wrong((tag + "rstd").c_str(), got[i].rstd, ref.rstd, 0, 1e-6);
    wrong += count_wrong((tag + "dx").c_str(), got[i].dx, cols(ref.dx, R, H, c0, h),
                         rt * std::max(1.0, rs), 10 * rt);
    if (s.affine)
      wrong += count_wrong((tag + "dgamma").c_str(), got[i].dgamma, cols(ref.dgamma, 1, H, c0, h),
                           rt * R, rt);
    if (s.centered) {
      wrong += count_wrong((tag + "mean").c_str(), got[i].mean, ref.mean, 1e-6, 1e-6);
      wrong += count_wrong((tag + "dbeta").c_str(), got[i].dbeta, cols(ref.dbeta, 1, H, c0, h),
                           rt * R, rt);
    }
  }
  EXPECT_EQ(sum_over_ranks(wrong), 0) << "elements out of tolerance, summed over " << P << " ranks";
  const double worst = max_over_ranks(max_abs_err());
  if (me == 0) std::printf("largest |got - want| over ranks: %.3g\n", worst);
}

// Bytes of the one collective: (sum rows_i * k_i + K + H) wire values, H = 10 or 2.
TEST(BatchedTraffic, OneCollectiveWithDocumentedBytes) {
  const int P = world_size(), me = world_rank();
  std::vector<Full> full;
  for (size_t i = 0; i < kSpecs.size(); ++i) full.push_back(make_full(kSpecs[i], 41 + i));
  std::vector<Split> splits;
  const auto items = shard(kSpecs, full, P, me, splits);
  uint64_t stats = 0;
  for (const Spec& s : kSpecs) stats += s.rows * (s.centered ? 2 : 1);
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  world->set_strict_calls(0);
  for (bool check : {true, false}) {
    for (Stats mode : {Stats::kRobust, Stats::kNaive}) {
      NormOptions opt;
      opt.check_agreement = check;
      opt.stats = mode;
      world->reset_counters();
      run_batched(*world, items, true, opt);
      const uint64_t values = stats + kSpecs.size() + (check ? 10 : 2);
      EXPECT_EQ(world->counters().calls, 2u);
      EXPECT_EQ(world->counters().bytes_sent, 2 * values * (mode == Stats::kRobust ? 8 : 4));
    }
  }
}

// A bad item on one rank, or ranks that disagree on an item, fail every rank together.
TEST(BatchedAgreement, FailuresReachEveryRank) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  world->set_strict_calls(-1);  // ranks that disagree on sizes never enter the payload collective
  std::vector<Full> full;
  for (size_t i = 0; i < kSpecs.size(); ++i) full.push_back(make_full(kSpecs[i], 51 + i));
  std::vector<Split> splits;
  auto items = shard(kSpecs, full, world_size(), world_rank(), splits);
  for (int variant = 0; variant < 2; ++variant) {
    auto mine = items;
    if (world_rank() == world_size() - 1) {
      if (variant == 0) mine[2].saved = DType::F16;  // not a statistics dtype
      if (variant == 1) mine[1].affine = false;      // the k-norm without its gamma
    }
    std::string msg;
    try {
      run_batched(*world, mine, false);
    } catch (const Error& e) {
      msg = e.what();
    }
    EXPECT_EQ(sum_over_ranks(msg.empty() ? 1 : 0), 0) << "a rank did not fail";
    const char* want = variant == 0 ? "items[2].rstd" : "item_digest";
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
  }
}

}  // namespace
