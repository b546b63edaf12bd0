// SyncBatchNorm on device memory (under mpiexec; ranks share the visible GPUs through the
// MPI-staged device communicator, or NCCL when each rank has its own GPU). Three training steps
// and one eval step, as tests/mpi/test_batch_norm_equiv.cpp, with every tensor (x, y, dy, dx,
// gamma, beta, running and saved statistics) in device memory: each must match BatchNorm on
// the concatenated batch in float64, element by element, with the CPU test's tolerances
// (r = fp32 1e-5, fp16 1e-3, bf16 8e-3): y r + r; save_mean 1e-6 + 1e-6; save_invstd 1e-5
// rel; running stats 1e-6 + 1e-5; dx r*max(1, invstd) + 10r; dgamma, dbeta summed over ranks
// r*count + r. Shapes cover both walks of the kernels (planes: NCHW; rows: channels-last and
// [N, C]) with every vector width, C not a multiple of 8, several splits per channel, uneven
// and empty batches. The eval step makes no collective, and its backward is also run without
// dgamma / dbeta (no partial pass). Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "batch_norm_reference.h"
#include "gpu_support.h"
#include "harness.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/cuda_mpi.h"
#include "tpnorm/error.h"

using namespace tpnorm;
using namespace tpnorm_test;
using tpnorm_gpu::DevBuf;

namespace {

struct Case {
  const char* name;
  int64_t c;
  std::vector<int64_t> spatial;
  int64_t per_rank[4];  // samples of rank i % 4
};

Shape shape_of(int64_t n, int64_t c, const std::vector<int64_t>& spatial, Layout layout) {
  Shape s;
  s.ndim = 2 + static_cast<int>(spatial.size());
  s.dims[0] = n;
  const int cdim = layout == Layout::kNCHW ? 1 : s.ndim - 1;
  s.dims[cdim] = c;
  for (size_t i = 0; i < spatial.size(); ++i) s.dims[(cdim == 1 ? 2 : 1) + i] = spatial[i];
  return s;
}

std::vector<float> sum_vec(const std::vector<float>& v) {
  std::vector<double> in(v.begin(), v.end()), out(v.size());
  MPI_Allreduce(in.data(), out.data(), static_cast<int>(in.size()), MPI_DOUBLE, MPI_SUM,
                MPI_COMM_WORLD);
  return {out.begin(), out.end()};
}

using Param = std::tuple<Case, Layout, DType, bool>;  // case, layout, dtype, nccl
class GpuBatchNorm : public ::testing::TestWithParam<Param> {};

TEST_P(GpuBatchNorm, MatchesConcatenatedBatchReference) {
  TPNORM_REQUIRE_GPU();
  const auto [cs, layout, dt, use_nccl] = GetParam();
  const int P = world_size(), me = world_rank();
#ifndef TPNORM_WITH_NCCL
  if (use_nccl) GTEST_SKIP() << "built without NCCL";
#endif
  if (use_nccl && tpnorm_gpu::gpu_count() < P)
    GTEST_SKIP() << "NCCL needs a GPU per rank: " << P << " ranks, " << tpnorm_gpu::gpu_count()
                 << " GPUs";
  const int dev = local_cuda_device(MPI_COMM_WORLD);
  cudaSetDevice(dev);
  cudaStream_t st = nullptr;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  std::unique_ptr<Communicator> comm;
#ifdef TPNORM_WITH_NCCL
  if (use_nccl) comm = make_nccl_communicator(MPI_COMM_WORLD, st);
#endif
  if (!comm) comm = make_mpi_staged_cuda_communicator(MPI_COMM_WORLD, st, dev);

  std::vector<int64_t> n(P);
  for (int i = 0; i < P; ++i) n[i] = cs.per_rank[i % 4];
  const int64_t C = cs.c, N = std::accumulate(n.begin(), n.end(), int64_t{0});
  const int64_t inner =
      std::accumulate(cs.spatial.begin(), cs.spatial.end(), int64_t{1}, std::multiplies<int64_t>());
  const int64_t nb = n[me], b0 = std::accumulate(n.begin(), n.begin() + me, int64_t{0});
  const int64_t per = C * inner, count = N * inner;
  const bool cl = layout == Layout::kChannelsLast;
  auto round = [&](std::vector<float> v) { return Buffer(dt, v).floats(); };
  auto mine = [&](const std::vector<float>& full) {
    std::vector<float> v(full.begin() + b0 * per, full.begin() + (b0 + nb) * per);
    return cl ? to_channels_last(v, nb, C, inner) : v;
  };
  auto want = [&](const std::vector<double>& full) {
    std::vector<double> v(full.begin() + b0 * per, full.begin() + (b0 + nb) * per);
    return cl ? to_channels_last(v, nb, C, inner) : v;
  };
  const auto gamma = round(normal(5, 1, C, 1.0, 0.5)), beta = round(normal(5, 2, C));
  DevBuf g(Buffer(dt, gamma), false, dev), b(Buffer(dt, beta), false, dev);
  DevBuf rm(Buffer(DType::F32, std::vector<float>(C, 0.f)), false, dev),
      rv(Buffer(DType::F32, std::vector<float>(C, 1.f)), false, dev),
      smean(Buffer(DType::F32, C), false, dev), sinv(Buffer(DType::F32, C), false, dev);
  std::vector<double> rm_ref(C, 0.0), rv_ref(C, 1.0);
  int64_t tracked = 0;
  BatchNormOptions opt;
  opt.layout = layout;
  const Shape xs = shape_of(nb, C, cs.spatial, layout), csh{C};
  const double rt = storage_rtol(dt);
  int64_t wrong = 0;
  for (int step = 0; step <= 3; ++step) {
    const bool eval = step == 3;
    opt.training = !eval;
    const auto x = round(normal(5, 10 + step, N * per, 0.5 * step, 1.5));
    const auto dy = round(normal(5, 20 + step, N * per));
    DevBuf xl(Buffer(dt, mine(x)), false, dev), dyl(Buffer(dt, mine(dy)), false, dev),
        y(Buffer(dt, nb * per), false, dev), dx(Buffer(dt, nb * per), false, dev),
        dg(Buffer(dt, C), false, dev), db(Buffer(dt, C), false, dev);
    comm->reset_counters();
    sync_batch_norm_forward(*comm, xl.view(xs), g.view(csh), b.view(csh), rm.view(csh),
                            rv.view(csh), &tracked, y.view(xs), smean.view(csh), sinv.view(csh),
                            opt);
    sync_batch_norm_backward(*comm, dyl.view(xs), xl.view(xs), g.view(csh), smean.view(csh),
                             sinv.view(csh), dx.view(xs), dg.view(csh), db.view(csh), opt);
    // Eval without parameter gradients skips the partial pass: dx from dy alone.
    DevBuf dx2(Buffer(dt, nb * per), false, dev);
    if (eval)
      sync_batch_norm_backward(*comm, dyl.view(xs), xl.view(xs), g.view(csh), smean.view(csh),
                               sinv.view(csh), dx2.view(xs), {}, {}, opt);
    EXPECT_NO_THROW(cuda_check_errors(*comm));
    if (eval && comm->counters().calls != 0) {
      ADD_FAILURE() << "eval made " << comm->counters().calls << " collectives";
      ++wrong;
    }
    BnRef ref;
    if (eval) {
      ref = batch_norm_eval_reference(x, N, C, inner, gamma, beta, rm_ref, rv_ref, opt.eps, dy);
    } else {
      ref = batch_norm_reference(x, N, C, inner, gamma, beta, opt.eps, dy);
      for (int64_t ch = 0; ch < C; ++ch) {
        rm_ref[ch] = 0.9 * rm_ref[ch] + 0.1 * ref.mean[ch];
        rv_ref[ch] = 0.9 * rv_ref[ch] + 0.1 * ref.var[ch] * count / (count - 1);
      }
    }
    std::vector<double> invstd(C);
    for (int64_t ch = 0; ch < C; ++ch) invstd[ch] = 1.0 / std::sqrt(ref.var[ch] + opt.eps);
    const double is_max = *std::max_element(invstd.begin(), invstd.end());
    wrong += count_wrong("y", y.floats(), want(ref.y), rt, rt);
    wrong += count_wrong("dx", dx.floats(), want(ref.dx), rt * std::max(1.0, is_max), 10 * rt);
    if (eval)
      wrong += count_wrong("dx (eval, no dgamma / dbeta)", dx2.floats(), want(ref.dx),
                           rt * std::max(1.0, is_max), 10 * rt);
    wrong += count_wrong("save_mean", smean.floats(), ref.mean, 1e-6, 1e-6);
    wrong += count_wrong("save_invstd", sinv.floats(), invstd, 0, 1e-5);
    wrong += count_wrong("dgamma summed", sum_vec(dg.floats()), ref.dgamma, rt * count, rt);
    wrong += count_wrong("dbeta summed", sum_vec(db.floats()), ref.dbeta, rt * count, rt);
  }
  wrong += count_wrong("running_mean", rm.floats(), rm_ref, 1e-6, 1e-5);
  wrong += count_wrong("running_var", rv.floats(), rv_ref, 1e-6, 1e-5);
  if (tracked != 3) {
    ADD_FAILURE() << "num_batches_tracked " << tracked << ", want 3";
    ++wrong;
  }
  EXPECT_EQ(sum_over_ranks(wrong), 0) << "elements out of tolerance, summed over ranks";
  comm.reset();
  cudaStreamDestroy(st);
}

const Case kCases[] = {
    {"c3_4x5_uneven", 3, {4, 5}, {3, 0, 5, 1}},  // narrow kernel (inner 20)
    {"c4_40_uneven", 4, {40}, {2, 1, 0, 3}},     // wide kernel (inner 40)
    {"c70_3", 70, {3}, {2, 2, 1, 2}},            // several 32-channel tiles
    {"c5_nospatial", 5, {}, {7, 0, 4, 2}},       // [N, C]
    {"c6_130_many", 6, {130}, {17, 9, 11, 1}},   // many samples, vectors of 2 (inner 130)
    // The kernels' walks (kernels/cuda/plan.h) at odd shapes: C not a multiple of 8, spatial
    // sizes that allow no vector, 16-byte vectors, and several splits per channel combined.
    {"c12_7x7", 12, {7, 7}, {3, 0, 2, 4}},           // inner 49: scalar planes; rows: vec 4
    {"c20_6x6", 20, {6, 6}, {2, 3, 1, 0}},           // inner 36: vec 4; rows: vec 4 of 20
    {"c64_16x16", 64, {16, 16}, {4, 3, 0, 2}},       // 16-byte vectors; 8 splits of 1024 rows
    {"c3_56x56_splits", 3, {56, 56}, {8, 5, 0, 7}},  // ~10 splits per channel combined
};

// A zero-size spatial dim ([n, 8, 0, 5], x and y null) on device: nothing may read x (an
// illegal address would kill the CUDA context: the synchronisation below reports it). Training
// has no value per channel on any rank: the device check sets the error word (the CPU op
// throws; a strict call may throw on the host first), running statistics stay untouched; eval
// is a valid no-op.
TEST(GpuBatchNormEmpty, ZeroSizeSpatialDimReadsNothing) {
  TPNORM_REQUIRE_GPU();
  const int dev = local_cuda_device(MPI_COMM_WORLD);
  cudaSetDevice(dev);
  cudaStream_t st = nullptr;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  auto comm = make_mpi_staged_cuda_communicator(MPI_COMM_WORLD, st, dev);
  const int64_t C = 8;
  for (Layout layout : {Layout::kNCHW, Layout::kChannelsLast}) {
    for (bool training : {true, false}) {
      const Shape xs = layout == Layout::kNCHW ? Shape{4, C, 0, 5} : Shape{4, 0, 5, C};
      const Shape csh{C};
      DevBuf rm(Buffer(DType::F32, std::vector<float>(C, 3.f)), false, dev),
          rv(Buffer(DType::F32, std::vector<float>(C, 2.f)), false, dev),
          smean(Buffer(DType::F32, std::vector<float>(C, 7.f)), false, dev),
          sinv(Buffer(DType::F32, std::vector<float>(C, 7.f)), false, dev);
      const TensorView none{static_cast<void*>(nullptr), DType::F32, xs, Device::cuda(dev)};
      BatchNormOptions opt;
      opt.layout = layout;
      opt.training = training;
      int64_t tracked = 0;
      bool threw = false;  // the host check of a strict call may catch it first
      try {
        sync_batch_norm_forward(*comm, none, {}, {}, rm.view(csh), rv.view(csh), &tracked, none,
                                smean.view(csh), sinv.view(csh), opt);
      } catch (const Error&) {
        threw = true;
      }
      EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess) << "the CUDA context died";
      if (training) {
        if (!threw) {
          EXPECT_THROW(cuda_check_errors(*comm), Error) << "no value on any rank";
        }
      } else {
        EXPECT_FALSE(threw);
        EXPECT_NO_THROW(cuda_check_errors(*comm));
      }
      for (float v : rm.floats()) EXPECT_EQ(v, 3.f);
      for (float v : rv.floats()) EXPECT_EQ(v, 2.f);
      if (training) {
        for (float v : smean.floats()) EXPECT_EQ(v, 7.f) << "saved mean written";
      }
    }
  }
  comm.reset();
  cudaStreamDestroy(st);
}

std::string name(const ::testing::TestParamInfo<Param>& i) {
  return std::string(std::get<0>(i.param).name) +
         (std::get<1>(i.param) == Layout::kNCHW ? "_nchw_" : "_channels_last_") +
         dtype_name(std::get<2>(i.param)) + (std::get<3>(i.param) ? "_nccl" : "_staged");
}

INSTANTIATE_TEST_SUITE_P(Staged, GpuBatchNorm,
                         ::testing::Combine(::testing::ValuesIn(kCases),
                                            ::testing::Values(Layout::kNCHW, Layout::kChannelsLast),
                                            ::testing::Values(DType::F32),
                                            ::testing::Values(false)),
                         name);
INSTANTIATE_TEST_SUITE_P(Half, GpuBatchNorm,
                         ::testing::Combine(::testing::Values(kCases[0], kCases[1], kCases[5],
                                                              kCases[6], kCases[7], kCases[8]),
                                            ::testing::Values(Layout::kNCHW, Layout::kChannelsLast),
                                            ::testing::Values(DType::F16, DType::BF16),
                                            ::testing::Values(false)),
                         name);
INSTANTIATE_TEST_SUITE_P(Nccl, GpuBatchNorm,
                         ::testing::Combine(::testing::Values(kCases[1], kCases[2]),
                                            ::testing::Values(Layout::kNCHW, Layout::kChannelsLast),
                                            ::testing::Values(DType::F32), ::testing::Values(true)),
                         name);

}  // namespace
