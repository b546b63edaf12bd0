// SyncBatchNorm's one-rank fused path (kernels/cpu/batch_norm.h bn_fused_*: a channel's
// statistics and outputs in one pass while its planes are in cache), run under mpiexec at 2, 3
// and 4 ranks.
//
// The fused path must give the bits of the two-pass path that every multi-rank call takes. On
// MPI_COMM_WORLD rank 0 holds the whole batch and every other rank an empty one, so the summed
// statistics are rank 0's own (adding zeros is exact) and rank 0's outputs are the two-pass
// path's on the whole batch; rank 0 then runs the same steps on a single-process communicator
// (the fused path, checked to be taken) at 1 and 2 threads. Two training steps and one eval
// step (forward + backward, running statistics, cumulative and momentum averages): y, dx,
// dgamma, dbeta, save_mean, save_invstd, running_mean, running_var must be bitwise equal, and
// the fused outputs must match BatchNorm in float64 on the batch (tolerances as
// test_batch_norm_equiv.cpp: r = one rounding of the dtype; y: r + r; dx: r*max(1, invstd) +
// 10r; dgamma, dbeta: r*count + r; save_mean 1e-6 + 1e-6; save_invstd 1e-5 rel; running
// statistics 1e-6 + 1e-5).
// Shapes: one sample, 7x7 planes (a vector and a tail per plane), 17 channels (not a multiple of
// the vector width), and a 33x33 plane (several of block_sums' blocks); fp32 and bf16 with
// float32 parameters.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>

#include "batch_norm_reference.h"
#include "harness.h"
#include "kernels/cpu/batch_norm.h"
#include "kernels/cpu/loops.h"
#include "storage.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

struct Case {
  const char* name;
  int64_t n, c, h, w;
  DType dt;
  double momentum;
};

// Everything a run of the steps writes, as bytes (bitwise comparisons) and floats (reference).
struct Outputs {
  std::vector<Buffer> y, dx, dgamma, dbeta;  // per step
  std::vector<std::vector<float>> save_mean, save_invstd;
  std::vector<float> running_mean, running_var;
  int64_t tracked = 0;
};

bool same_bits(const Buffer& a, const Buffer& b) {
  const auto fa = a.floats(), fb = b.floats();
  return fa.size() == fb.size() &&
         (fa.empty() || std::memcmp(fa.data(), fb.data(), fa.size() * sizeof(float)) == 0);
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

std::vector<float> input(const Case& k, uint64_t stream, double mean, double sd) {
  return Buffer(k.dt, normal(41, stream, k.n * k.c * k.h * k.w, mean, sd)).floats();
}

// Two training steps and an eval step on `comm`; `local` false: this rank passes an empty batch.
Outputs run_steps(Communicator& comm, const Case& k, bool local, int threads) {
  const int64_t n = local ? k.n : 0, C = k.c;
  const Shape xs{n, C, k.h, k.w}, cs{C};
  const std::vector<float> gamma = normal(41, 1, C, 1.0, 0.5), beta = normal(41, 2, C);
  std::vector<float> g32(gamma), b32(beta);
  BatchNormOptions opt;
  opt.momentum = k.momentum;
  opt.num_threads = threads;
  Outputs o;
  o.running_mean.assign(C, 0.f);
  o.running_var.assign(C, 1.f);
  for (int step = 0; step < 3; ++step) {
    opt.training = step < 2;
    const size_t len = static_cast<size_t>(n * C * k.h * k.w);
    auto x = input(k, 10 + step, 3.0 + step, 1.5), dy = input(k, 20 + step, 0.0, 1.0);
    x.resize(len);
    dy.resize(len);
    Buffer xb(k.dt, x), dyb(k.dt, dy), y(k.dt, len), dx(k.dt, len), dg(DType::F32, C),
        db(DType::F32, C);
    std::vector<float> sm(C), si(C);
    sync_batch_norm_forward(comm, xb.view(xs), view(g32.data(), cs), view(b32.data(), cs),
                            view(o.running_mean.data(), cs), view(o.running_var.data(), cs),
                            &o.tracked, y.view(xs), view(sm.data(), cs), view(si.data(), cs), opt);
    sync_batch_norm_backward(comm, dyb.view(xs), xb.view(xs), view(g32.data(), cs),
                             view(sm.data(), cs), view(si.data(), cs), dx.view(xs), dg.view(cs),
                             db.view(cs), opt);
    o.y.push_back(y);
    o.dx.push_back(dx);
    o.dgamma.push_back(dg);
    o.dbeta.push_back(db);
    o.save_mean.push_back(sm);
    o.save_invstd.push_back(si);
  }
  return o;
}

// Elements of the fused outputs out of tolerance against float64 BatchNorm on the batch.
int64_t wrong_vs_reference(const Case& k, const Outputs& o) {
  const int64_t C = k.c, inner = k.h * k.w, count = k.n * inner;
  const std::vector<float> gamma = normal(41, 1, C, 1.0, 0.5), beta = normal(41, 2, C);
  std::vector<double> rm(C, 0.0), rv(C, 1.0);
  const double rt = storage_rtol(k.dt), rtp = storage_rtol(DType::F32);
  int64_t wrong = 0;
  for (int step = 0; step < 3; ++step) {
    const auto x = input(k, 10 + step, 3.0 + step, 1.5), dy = input(k, 20 + step, 0.0, 1.0);
    BnRef ref;
    if (step == 2) {
      ref = batch_norm_eval_reference(x, k.n, C, inner, gamma, beta, rm, rv, 1e-5, dy);
    } else {
      ref = batch_norm_reference(x, k.n, C, inner, gamma, beta, 1e-5, dy);
      const double m = std::isnan(k.momentum) ? 1.0 / (step + 1) : k.momentum;
      for (int64_t ch = 0; ch < C; ++ch) {
        rm[ch] = (1 - m) * rm[ch] + m * ref.mean[ch];
        rv[ch] = (1 - m) * rv[ch] + m * ref.var[ch] * count / (count - 1);
      }
    }
    std::vector<double> invstd(C);
    for (int64_t ch = 0; ch < C; ++ch) invstd[ch] = 1.0 / std::sqrt(ref.var[ch] + 1e-5);
    const double is_max = *std::max_element(invstd.begin(), invstd.end());
    wrong += count_wrong("y", o.y[step].floats(), ref.y, rt, rt);
    wrong += count_wrong("dx", o.dx[step].floats(), ref.dx, rt * std::max(1.0, is_max), 10 * rt);
    wrong += count_wrong("dgamma", o.dgamma[step].floats(), ref.dgamma, rtp * count, rtp);
    wrong += count_wrong("dbeta", o.dbeta[step].floats(), ref.dbeta, rtp * count, rtp);
    if (step < 2) {
      wrong += count_wrong("save_mean", o.save_mean[step], ref.mean, 1e-6, 1e-6);
      wrong += count_wrong("save_invstd", o.save_invstd[step], invstd, 0, 1e-5);
    }
  }
  wrong += count_wrong("running_mean", o.running_mean, rm, 1e-6, 1e-5);
  wrong += count_wrong("running_var", o.running_var, rv, 1e-6, 1e-5);
  return wrong;
}

// Fields of a and b that differ bitwise, named.
std::string bit_differences(const Outputs& a, const Outputs& b) {
  std::string d;
  for (size_t s = 0; s < a.y.size(); ++s) {
    const std::string at = " (step " + std::to_string(s) + ")";
    if (!same_bits(a.y[s], b.y[s])) d += " y" + at;
    if (!same_bits(a.dx[s], b.dx[s])) d += " dx" + at;
    if (!same_bits(a.dgamma[s], b.dgamma[s])) d += " dgamma" + at;
    if (!same_bits(a.dbeta[s], b.dbeta[s])) d += " dbeta" + at;
    if (!same_bits(a.save_mean[s], b.save_mean[s])) d += " save_mean" + at;
    if (!same_bits(a.save_invstd[s], b.save_invstd[s])) d += " save_invstd" + at;
  }
  if (!same_bits(a.running_mean, b.running_mean)) d += " running_mean";
  if (!same_bits(a.running_var, b.running_var)) d += " running_var";
  if (a.tracked != b.tracked) d += " num_batches_tracked";
  return d;
}

// The fused path (checked to be taken) against the multi-rank path and the reference.
void check_fused_bits(const Case& k) {
  const bool root = world_rank() == 0;
  // The case takes the fused path at 1 and 2 threads (forward: x; backward: x and dy).
  kernels::cpu::BatchNormArgs a;
  a.n = k.n;
  a.c = k.c;
  a.inner = k.h * k.w;
  for (int t : {1, 2}) {
    a.threads = t;
    ASSERT_TRUE(kernels::cpu::bn_fuses(a, 2 * static_cast<int64_t>(dtype_size(k.dt))))
        << "threads " << t;
  }
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  const Outputs multi = run_steps(*world, k, root, 1);
  int64_t wrong = 0;
  if (root) {
    auto single = make_single_communicator();
    for (int t : {1, 2}) {
      const Outputs fused = run_steps(*single, k, true, t);
      const std::string diff = bit_differences(fused, multi);
      if (!diff.empty()) {
        ADD_FAILURE() << "threads " << t << ": the fused path's bits differ in" << diff;
        ++wrong;
      }
      wrong += wrong_vs_reference(k, fused);
    }
  }
  EXPECT_EQ(sum_over_ranks(wrong), 0) << "wrong elements or fields, summed over ranks";
}

class BatchNormOneRank : public ::testing::TestWithParam<Case> {};

TEST_P(BatchNormOneRank, FusedPathHasTheMultiRankBits) { check_fused_bits(GetParam()); }

// A channel larger than the core's L2 but within the fused path's budget (L2 plus a share of
// the last-level cache, bn_fused_channel_bytes): re-read partly from the L3, the same bits.
TEST(BatchNormOneRankLarge, ChannelBeyondL2TakesTheFusedPathWithTheMultiRankBits) {
  const int64_t l2 = kernels::cpu::l2_cache_bytes();
  const int64_t budget = kernels::cpu::bn_fused_channel_bytes(2);
  ASSERT_GT(budget, l2);
  // 2 samples of a square plane, x and dy in float32: 16 bytes per plane element.
  const int64_t side = static_cast<int64_t>(std::sqrt(static_cast<double>(l2 + budget) / 2 / 16));
  const Case k{"n2_c2_beyond_l2_f32", 2, 2, side, side, DType::F32, 0.1};
  ASSERT_GT(k.n * k.h * k.w * 8, l2) << "the case's channel must exceed the L2";
  check_fused_bits(k);
}

const double kCumulative = BatchNormOptions::cumulative();
const Case kCases[] = {
    {"n1_c17_7x7_f32", 1, 17, 7, 7, DType::F32, 0.1},
    {"n1_c17_7x7_bf16", 1, 17, 7, 7, DType::BF16, kCumulative},
    {"n3_c2_33x33_f32", 3, 2, 33, 33, DType::F32, kCumulative},
    {"n2_c9_7x7_bf16", 2, 9, 7, 7, DType::BF16, 0.1},
};

INSTANTIATE_TEST_SUITE_P(Nchw, BatchNormOneRank, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

}  // namespace
