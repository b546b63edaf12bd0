// Multi-rank equivalence of hidden-sharded LayerNorm / RMSNorm, run under mpiexec at 2, 3, 4.
//
// Every rank makes the full input from a seed and keeps its columns; the sharded op's y, mean,
// rstd, dx, dgamma, dbeta must match, element by element, (a) the float64 reference on the full
// data and (b) the single-process op on the full input. Tolerances (abs + rel*|want|), with
// r = one rounding of the storage dtype (fp32 1e-5, fp16 1e-3, bf16 8e-3):
//   y: r + r;  mean, rstd: 1e-6 rel (fp32 accumulation of the same rounded inputs);
//   dx: r * max(1, rstd) + 10 r;  dgamma, dbeta (sums over rows): r * rows + r.
#include <gtest/gtest.h>

#include <algorithm>

#include "harness.h"
#include "reference.h"
#include "storage.h"
#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

enum class SplitKind { kEven, kZeroOnRank1, kAllOnLast };

struct Case {
  const char* name;
  int64_t rows, hidden;
  SplitKind split;
  double offset;
  DType saved = DType::F32;  // dtype of the saved mean / rstd
};

struct Result {
  std::vector<float> y, mean, rstd, dx, dgamma, dbeta;
};

// One forward + backward on `comm` over this rank's columns [c0, c0+h) of the full data.
Result run(Communicator& comm, bool centered, DType dt, const Case& c, int64_t c0, int64_t h,
           const std::vector<float>& x_full, const std::vector<float>& dy_full,
           const std::vector<float>& gamma_full, const std::vector<float>& beta_full) {
  const int64_t R = c.rows;
  Buffer x(dt, columns(x_full, R, c.hidden, c0, h)), dy(dt, columns(dy_full, R, c.hidden, c0, h));
  Buffer gamma, beta;
  const bool affine = !gamma_full.empty();
  if (affine) {
    gamma = Buffer(dt, columns(gamma_full, 1, c.hidden, c0, h));
    beta = Buffer(dt, columns(beta_full, 1, c.hidden, c0, h));
  }
  Buffer y(dt, R * h), dx(dt, R * h), dg(dt, h), db(dt, h);
  Buffer mean(c.saved, R), rstd(c.saved, R);
  const Shape s{R, h}, p{h}, r{R};
  const TensorView gv = affine ? gamma.view(p) : TensorView{};
  const TensorView bv = affine && centered ? beta.view(p) : TensorView{};
  if (centered) {
    layer_norm_forward(comm, x.view(s), gv, bv, y.view(s), mean.view(r), rstd.view(r));
    layer_norm_backward(comm, dy.view(s), x.view(s), gv, mean.view(r), rstd.view(r), dx.view(s),
                        dg.view(p), db.view(p));
  } else {
    rms_norm_forward(comm, x.view(s), gv, y.view(s), rstd.view(r));
    rms_norm_backward(comm, dy.view(s), x.view(s), gv, rstd.view(r), dx.view(s), dg.view(p));
  }
  return {y.floats(), mean.floats(), rstd.floats(), dx.floats(), dg.floats(), db.floats()};
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }
std::vector<double> cols(const std::vector<double>& m, int64_t rows, int64_t cols_, int64_t c0,
                         int64_t nc) {
  std::vector<double> out(static_cast<size_t>(rows * nc));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < nc; ++c) out[r * nc + c] = m[r * cols_ + c0 + c];
  return out;
}

using Param = std::tuple<Case, bool, bool, DType>;
class RowNormEquivalence : public ::testing::TestWithParam<Param> {};

TEST_P(RowNormEquivalence, MatchesUnshardedReferenceAndSingleProcess) {
  const auto [c, centered, affine, dt] = GetParam();
  const int P = world_size(), me = world_rank();
  std::vector<int> weights(P, 1);
  if (c.split == SplitKind::kZeroOnRank1 && P > 1) weights[1] = 0;
  if (c.split == SplitKind::kAllOnLast) std::fill(weights.begin(), weights.end() - 1, 0);
  const Split sp = split_weighted(c.hidden, weights);
  const int64_t c0 = sp.offset[me], h = sp.count[me];

  // Inputs rounded to the storage dtype once, so the reference sees what the op sees.
  auto round = [&](std::vector<float> v) { return Buffer(dt, v).floats(); };
  const auto x = round(normal(42, 0, c.rows * c.hidden, c.offset, 1.5));
  const auto dy = round(normal(42, 1, c.rows * c.hidden));
  const auto gamma = affine ? round(normal(42, 2, c.hidden, 1.0, 0.5)) : std::vector<float>{};
  const auto beta = affine ? round(normal(42, 3, c.hidden)) : std::vector<float>{};

  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  const Result got = run(*world, centered, dt, c, c0, h, x, dy, gamma, beta);
  auto single = make_single_communicator();
  const Result one = run(*single, centered, dt, c, 0, c.hidden, x, dy, gamma, beta);
  const RowRef ref = row_norm_reference(centered, x, c.rows, c.hidden, gamma,
                                        centered ? beta : std::vector<float>{}, 1e-5, dy);

  const double rt = storage_rtol(dt);
  const double rs_max = *std::max_element(ref.rstd.begin(), ref.rstd.end());
  struct Check {
    const char* what;
    const std::vector<float>& got;
    std::vector<double> want;
    double atol, rtol;
  };
  auto dx_tol = rt * std::max(1.0, rs_max);
  std::vector<Check> checks = {
      {"y", got.y, cols(ref.y, c.rows, c.hidden, c0, h), rt, rt},
      {"rstd", got.rstd, ref.rstd, 0, 1e-6},
      {"dx", got.dx, cols(ref.dx, c.rows, c.hidden, c0, h), dx_tol, 10 * rt},
      {"dgamma", got.dgamma, cols(ref.dgamma, 1, c.hidden, c0, h), rt * c.rows, rt},
      {"y vs single", got.y, cols(to_double(one.y), c.rows, c.hidden, c0, h), rt, rt},
      {"rstd vs single", got.rstd, to_double(one.rstd), 0, 1e-6},
      {"dx vs single", got.dx, cols(to_double(one.dx), c.rows, c.hidden, c0, h), dx_tol, 10 * rt},
      {"dgamma vs single", got.dgamma, cols(to_double(one.dgamma), 1, c.hidden, c0, h), rt * c.rows,
       rt},
  };
  if (centered) {
    checks.push_back({"mean", got.mean, ref.mean, 1e-6, 1e-6});
    checks.push_back({"dbeta", got.dbeta, cols(ref.dbeta, 1, c.hidden, c0, h), rt * c.rows, rt});
    checks.push_back({"mean vs single", got.mean, to_double(one.mean), 1e-6, 1e-6});
  }
  int64_t wrong = 0;
  for (const Check& k : checks) wrong += count_wrong(k.what, k.got, k.want, k.atol, k.rtol);
  EXPECT_EQ(sum_over_ranks(wrong), 0) << "elements out of tolerance, summed over " << P << " ranks";
}

const Case kCases[] = {
    {"r64_h1000_even", 64, 1000, SplitKind::kEven, 0.0},
    {"r1_h4096_even", 1, 4096, SplitKind::kEven, 0.0},
    {"r17_h33_zero_on_rank1", 17, 33, SplitKind::kZeroOnRank1, 0.0},
    {"r5_h3_even", 5, 3, SplitKind::kEven, 0.0},  // at 4 ranks one rank has no column
    {"r9_h70_all_on_last", 9, 70, SplitKind::kAllOnLast, 0.0},
    // 1e4 + N(0,1): forward statistics stay exact in the default mode. The backward needs the
    // mean to better than float32's ulp(1e4) = 1e-3, so this case saves float64 statistics.
    {"r8_h1000_offset1e4", 8, 1000, SplitKind::kEven, 1e4, DType::F64},
};

std::string name(const ::testing::TestParamInfo<Param>& i) {
  return std::string(std::get<1>(i.param) ? "LayerNorm_" : "RMSNorm_") + std::get<0>(i.param).name +
         (std::get<2>(i.param) ? "_affine_" : "_plain_") + dtype_name(std::get<3>(i.param));
}

INSTANTIATE_TEST_SUITE_P(Fp32, RowNormEquivalence,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Bool(),
                                            ::testing::Bool(), ::testing::Values(DType::F32)),
                         name);
INSTANTIATE_TEST_SUITE_P(Half, RowNormEquivalence,
                         ::testing::Combine(::testing::Values(kCases[0], kCases[2]),
                                            ::testing::Bool(), ::testing::Values(true),
                                            ::testing::Values(DType::F16, DType::BF16)),
                         name);

// Exactly one collective per forward and per backward, with the documented payload.
TEST(RowNormTraffic, OneCollectivePerCallWithDocumentedBytes) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  world->set_strict_calls(0);  // the fingerprint folded into the payload collective
  const int64_t R = 12, h = 5;
  std::vector<float> x = normal(5, world_rank(), R * h), y(R * h), dx(R * h), mean(R), rstd(R);
  const Shape s{R, h}, r{R};
  for (bool check : {true, false}) {
    for (Stats mode : {Stats::kRobust, Stats::kNaive}) {
      NormOptions opt;
      opt.check_agreement = check;
      opt.stats = mode;
      const uint64_t header = check ? 10 : 2, vsize = mode == Stats::kRobust ? 8 : 4;
      world->reset_counters();
      layer_norm_forward(*world, view(x.data(), s), {}, {}, view(y.data(), s), view(mean.data(), r),
                         view(rstd.data(), r), opt);
      EXPECT_EQ(world->counters().calls, 1u);
      EXPECT_EQ(world->counters().bytes_sent, (2 * R + header) * vsize);
      layer_norm_backward(*world, view(x.data(), s), view(x.data(), s), {}, view(mean.data(), r),
                          view(rstd.data(), r), view(dx.data(), s), {}, {}, opt);
      EXPECT_EQ(world->counters().calls, 2u);
      EXPECT_EQ(world->counters().bytes_sent, 2 * (2 * R + header) * vsize);
      world->reset_counters();
      rms_norm_forward(*world, view(x.data(), s), {}, view(y.data(), s), view(rstd.data(), r), opt);
      rms_norm_backward(*world, view(x.data(), s), view(x.data(), s), {}, view(rstd.data(), r),
                        view(dx.data(), s), {}, opt);
      EXPECT_EQ(world->counters().calls, 2u);
      EXPECT_EQ(world->counters().bytes_sent, 2 * (R + header) * vsize);
    }
  }
}

}  // namespace
