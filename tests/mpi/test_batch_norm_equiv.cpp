// Multi-rank equivalence of SyncBatchNorm, run under mpiexec at 2, 3 and 4 ranks.
//
// Every rank makes the full batch from a seed and keeps its samples (per-rank batch sizes may
// differ and may be 0). Three training steps (forward + backward) and then one eval step must
// match, element by element, BatchNorm on the concatenated batch in float64 with the running
// statistics updated as PyTorch does. Tolerances (abs + rel*|want|), r = one rounding of the
// storage dtype (fp32 1e-5, fp16 1e-3, bf16 8e-3):
//   y: r + r;  save_mean: 1e-6 + 1e-6;  save_invstd: 1e-5 rel;  running stats: 1e-6 + 1e-5
//   (float32 state over 3 updates);  dx: r*max(1, invstd) + 10r;
//   dgamma, dbeta (local sums, summed over ranks here): r*count + r.
// Mixed precision (fp16/bf16 x, y, dy, dx with float32 gamma/beta/dgamma/dbeta): the same, with
// gamma/beta rounded to float32 and dgamma/dbeta held to float32's r.
// The eval step must also send nothing (the communicator's counters stay at 0).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "batch_norm_reference.h"
#include "harness.h"
#include "storage.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

enum class Batches { kUneven, kEven, kOnlyFirst };

struct Case {
  const char* name;
  int64_t c;
  std::vector<int64_t> spatial;
  Batches batches;
};

std::vector<int64_t> batch_sizes(Batches b, int p) {
  std::vector<int64_t> n(p);
  const int64_t uneven[] = {3, 0, 5, 1};
  for (int i = 0; i < p; ++i)
    n[i] = b == Batches::kUneven ? uneven[i % 4] : b == Batches::kEven ? 2 : (i == 0 ? 4 : 0);
  return n;
}

Shape shape_of(int64_t n, int64_t c, const std::vector<int64_t>& spatial, Layout layout) {
  Shape s;
  s.ndim = 2 + static_cast<int>(spatial.size());
  s.dims[0] = n;
  const int cdim = layout == Layout::kNCHW ? 1 : s.ndim - 1;
  s.dims[cdim] = c;
  for (size_t i = 0; i < spatial.size(); ++i) s.dims[(cdim == 1 ? 2 : 1) + i] = spatial[i];
  return s;
}

// Sum over the ranks of `comm` (in double, then rounded once to float for count_wrong).
std::vector<float> sum_vec(const std::vector<float>& v, MPI_Comm comm) {
  std::vector<double> in(v.begin(), v.end()), out(v.size());
  MPI_Allreduce(in.data(), out.data(), static_cast<int>(in.size()), MPI_DOUBLE, MPI_SUM, comm);
  return {out.begin(), out.end()};
}

struct Scenario {
  Case c;
  Layout layout;
  bool affine;
  double momentum;
  DType dt = DType::F32;
  bool fp32_params = false;  ///< gamma/beta/dgamma/dbeta float32 next to a half dt
};

// Runs 3 training steps and one eval step of SyncBatchNorm on `mpi` (this rank holds n[me]
// samples) and returns the number of wrong elements on this rank. Every collective is reached.
int64_t run_steps(MPI_Comm mpi, const Scenario& su, const std::vector<int64_t>& n, uint64_t seed) {
  int me = 0;
  MPI_Comm_rank(mpi, &me);
  auto comm = make_mpi_communicator(mpi);
  const DType dt = su.dt, pdt = su.fp32_params ? DType::F32 : su.dt;
  const int64_t C = su.c.c, N = std::accumulate(n.begin(), n.end(), int64_t{0});
  const int64_t inner = std::accumulate(su.c.spatial.begin(), su.c.spatial.end(), int64_t{1},
                                        std::multiplies<int64_t>());
  const int64_t nb = n[me], b0 = std::accumulate(n.begin(), n.begin() + me, int64_t{0});
  const int64_t per = C * inner, count = N * inner;
  const bool cl = su.layout == Layout::kChannelsLast;
  auto round = [&](std::vector<float> v) { return Buffer(dt, v).floats(); };
  auto round_p = [&](std::vector<float> v) { return Buffer(pdt, v).floats(); };
  // This rank's samples of a full NCHW tensor, in the op's layout; and the reverse for outputs.
  auto mine = [&](const std::vector<float>& full) {
    std::vector<float> v(full.begin() + b0 * per, full.begin() + (b0 + nb) * per);
    return cl ? to_channels_last(v, nb, C, inner) : v;
  };
  auto want = [&](const std::vector<double>& full) {
    std::vector<double> v(full.begin() + b0 * per, full.begin() + (b0 + nb) * per);
    return cl ? to_channels_last(v, nb, C, inner) : v;
  };

  const std::vector<float> gamma =
      su.affine ? round_p(normal(seed, 1, C, 1.0, 0.5)) : std::vector<float>{};
  const std::vector<float> beta = su.affine ? round_p(normal(seed, 2, C)) : std::vector<float>{};
  Buffer g(pdt, gamma), b(pdt, beta);
  const TensorView gv = su.affine ? g.view({C}) : TensorView{};
  const TensorView bv = su.affine ? b.view({C}) : TensorView{};
  std::vector<float> rm(C, 0.f), rv(C, 1.f), smean(C), sinv(C);
  std::vector<double> rm_ref(C, 0.0), rv_ref(C, 1.0);
  int64_t tracked = 0;
  BatchNormOptions opt;
  opt.layout = su.layout;
  opt.momentum = su.momentum;
  const Shape xs = shape_of(nb, C, su.c.spatial, su.layout), cs{C};
  const double rt = storage_rtol(dt), rtp = storage_rtol(pdt);
  int64_t wrong = 0;

  for (int step = 0; step <= 3; ++step) {
    const bool eval = step == 3;
    opt.training = !eval;
    const auto x = round(normal(seed, 10 + step, N * per, 0.5 * step, 1.5));
    const auto dy = round(normal(seed, 20 + step, N * per));
    Buffer xl(dt, mine(x)), dyl(dt, mine(dy)), y(dt, nb * per), dx(dt, nb * per);
    Buffer dg(pdt, C), db(pdt, C);
    comm->reset_counters();
    sync_batch_norm_forward(*comm, xl.view(xs), gv, bv, view(rm.data(), cs), view(rv.data(), cs),
                            &tracked, y.view(xs), view(smean.data(), cs), view(sinv.data(), cs),
                            opt);
    sync_batch_norm_backward(*comm, dyl.view(xs), xl.view(xs), gv, view(smean.data(), cs),
                             view(sinv.data(), cs), dx.view(xs), dg.view(cs), db.view(cs), opt);
    const uint64_t calls = comm->counters().calls, bytes = comm->counters().bytes_sent;
    const auto dg_sum = sum_vec(dg.floats(), mpi), db_sum = sum_vec(db.floats(), mpi);

    BnRef ref;
    if (eval) {
      ref = batch_norm_eval_reference(x, N, C, inner, gamma, beta, rm_ref, rv_ref, opt.eps, dy);
      if (calls != 0 || bytes != 0) {
        ADD_FAILURE() << "eval sent " << calls << " collectives, " << bytes << " bytes";
        ++wrong;
      }
    } else {
      ref = batch_norm_reference(x, N, C, inner, gamma, beta, opt.eps, dy);
      const double m = std::isnan(su.momentum) ? 1.0 / (step + 1) : su.momentum;
      for (int64_t ch = 0; ch < C; ++ch) {
        rm_ref[ch] = (1 - m) * rm_ref[ch] + m * ref.mean[ch];
        rv_ref[ch] = (1 - m) * rv_ref[ch] + m * ref.var[ch] * count / (count - 1);
      }
    }
    std::vector<double> invstd(C);
    for (int64_t ch = 0; ch < C; ++ch) invstd[ch] = 1.0 / std::sqrt(ref.var[ch] + opt.eps);
    const double is_max = *std::max_element(invstd.begin(), invstd.end());
    wrong += count_wrong("y", y.floats(), want(ref.y), rt, rt);
    wrong += count_wrong("dx", dx.floats(), want(ref.dx), rt * std::max(1.0, is_max), 10 * rt);
    wrong += count_wrong("save_mean", smean, ref.mean, 1e-6, 1e-6);
    wrong += count_wrong("save_invstd", sinv, invstd, 0, 1e-5);
    wrong += count_wrong("dgamma summed", dg_sum, ref.dgamma, rtp * count, rtp);
    wrong += count_wrong("dbeta summed", db_sum, ref.dbeta, rtp * count, rtp);
  }
  wrong += count_wrong("running_mean", rm, rm_ref, 1e-6, 1e-5);
  wrong += count_wrong("running_var", rv, rv_ref, 1e-6, 1e-5);
  if (tracked != 3) {
    ADD_FAILURE() << "num_batches_tracked " << tracked << ", want 3";
    ++wrong;
  }
  return wrong;
}

using Param = std::tuple<Case, Layout, bool, double>;
class BatchNormEquivalence : public ::testing::TestWithParam<Param> {};

TEST_P(BatchNormEquivalence, MatchesConcatenatedBatchReference) {
  const auto [c, layout, affine, momentum] = GetParam();
  const Scenario su{c, layout, affine, momentum};
  const int64_t wrong = run_steps(MPI_COMM_WORLD, su, batch_sizes(c.batches, world_size()), 7);
  EXPECT_EQ(sum_over_ranks(wrong), 0) << "elements out of tolerance, summed over ranks";
}

const Case kCases[] = {
    {"c3_4x5_uneven", 3, {4, 5}, Batches::kUneven},
    {"c5_nospatial_uneven", 5, {}, Batches::kUneven},  // [N, C]: BatchNorm1d
    {"c2_3x2x3_even", 2, {3, 2, 3}, Batches::kEven},   // three spatial dims
    {"c7_5_only_rank0", 7, {5}, Batches::kOnlyFirst},  // every other rank is empty
};

std::string name(const ::testing::TestParamInfo<Param>& i) {
  return std::string(std::get<0>(i.param).name) +
         (std::get<1>(i.param) == Layout::kNCHW ? "_nchw" : "_channels_last") +
         (std::get<2>(i.param) ? "_affine" : "_plain") +
         (std::isnan(std::get<3>(i.param)) ? "_cumulative" : "_momentum");
}

INSTANTIATE_TEST_SUITE_P(Fp32, BatchNormEquivalence,
                         ::testing::Combine(::testing::ValuesIn(kCases),
                                            ::testing::Values(Layout::kNCHW, Layout::kChannelsLast),
                                            ::testing::Bool(),
                                            ::testing::Values(0.1, BatchNormOptions::cumulative())),
                         name);

TEST(BatchNormEquivalenceHalf, Fp16AndBf16MatchWithinStorageTolerance) {
  int64_t wrong = 0;
  for (DType dt : {DType::F16, DType::BF16})
    for (Layout l : {Layout::kNCHW, Layout::kChannelsLast}) {
      const Scenario su{kCases[0], l, true, 0.1, dt};
      wrong += run_steps(MPI_COMM_WORLD, su, batch_sizes(Batches::kUneven, world_size()), 9);
    }
  EXPECT_EQ(sum_over_ranks(wrong), 0);
}

// Mixed precision as autocast runs BatchNorm: fp16/bf16 x with float32 gamma/beta, whose
// gradients must come out at float32's tolerance (not rounded through the activations' dtype).
TEST(BatchNormEquivalenceMixed, HalfXWithFp32ParamsMatchAtFp32ParamTolerance) {
  int64_t wrong = 0;
  for (DType dt : {DType::F16, DType::BF16})
    for (Layout l : {Layout::kNCHW, Layout::kChannelsLast})
      for (int i : {0, 1, 3}) {  // uneven with a rank empty, [N, C], only rank 0 holding data
        const Case& c = kCases[i];
        const double momentum = i == 1 ? BatchNormOptions::cumulative() : 0.1;
        const Scenario su{c, l, true, momentum, dt, true};
        wrong += run_steps(MPI_COMM_WORLD, su, batch_sizes(c.batches, world_size()), 11);
      }
  EXPECT_EQ(sum_over_ranks(wrong), 0);
}

// A 2x2 grid: ranks {0,1} and {2,3} are the data-parallel groups (same tensor-parallel index
// across groups would be {0,2}, {1,3}). Both groups run SyncBatchNorm at once, each with its
// own data, and must match the reference on their own concatenated batch.
TEST(BatchNormSubgroups, TwoDataParallelGroupsAtOnce) {
  if (world_size() != 4) GTEST_SKIP() << "needs exactly 4 ranks for the 2x2 grid";
  const int me = world_rank();
  MPI_Comm dp = MPI_COMM_NULL, tp = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, me / 2, me, &dp);  // data-parallel group
  MPI_Comm_split(MPI_COMM_WORLD, me % 2, me, &tp);  // tensor-parallel group (unused by BN)
  const Scenario su{kCases[0], Layout::kChannelsLast, true, 0.1};
  const std::vector<int64_t> n =
      me / 2 == 0 ? std::vector<int64_t>{3, 0} : std::vector<int64_t>{2, 5};
  const int64_t wrong = run_steps(dp, su, n, 100 + me / 2);  // each group its own data
  MPI_Comm_free(&tp);
  MPI_Comm_free(&dp);
  EXPECT_EQ(sum_over_ranks(wrong), 0);
}

}  // namespace
