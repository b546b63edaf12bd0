// Several ranks on the visible GPUs (under mpiexec): hidden-sharded LayerNorm / RMSNorm on
// device memory through (a) the MPI-staged device communicator, which lets any number of
// ranks share one GPU, and (b) NCCL, when every rank has its own GPU (NCCL refuses two ranks
// on one GPU; with one GPU that is world size 1). Each rank's shard must match the float64
// reference on the full data and the CPU op on the same shards over MPI, element by element
// (tolerances in gpu_checks.h). Also: one device collective per call, cross-rank errors (strict
// on the host, later calls on device), and an NCCL call captured in a CUDA graph.
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <cstring>

#include "gpu_checks.h"
#include "tpnorm/cuda_mpi.h"
#include "tpnorm/error.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_gpu;
using tpnorm_test::Buffer;

namespace {

enum class Kind { kStaged, kNccl };

struct Case {
  const char* name;
  int64_t rows, hidden;
  bool zero_on_rank1 = false;
};

// The communicator of `kind` on this rank's GPU, or a reason to skip (same on every rank).
std::unique_ptr<Communicator> make_comm(Kind kind, cudaStream_t* s, std::string* skip) {
  const int P = tpnorm_test::world_size();
  if (kind == Kind::kNccl) {
#ifndef TPNORM_WITH_NCCL
    *skip = "built without NCCL";
    return nullptr;
#else
    if (gpu_count() < P) {
      *skip = "NCCL needs a GPU per rank: " + std::to_string(P) + " ranks, " +
              std::to_string(gpu_count()) + " GPUs";
      return nullptr;
    }
#endif
  }
  const int dev = local_cuda_device(MPI_COMM_WORLD);
  cudaSetDevice(dev);
  cudaStreamCreateWithFlags(s, cudaStreamNonBlocking);
#ifdef TPNORM_WITH_NCCL
  if (kind == Kind::kNccl) return make_nccl_communicator(MPI_COMM_WORLD, *s);
#endif
  return make_mpi_staged_cuda_communicator(MPI_COMM_WORLD, *s, dev);
}

struct Shard {
  RowIn in;    // this rank's columns
  RowIn full;  // all columns (for the reference)
  int64_t c0 = 0;
};

Shard make_shard(const Case& c, DType dt) {
  const int P = tpnorm_test::world_size(), me = tpnorm_test::world_rank();
  std::vector<int> weights(P, 1);
  if (c.zero_on_rank1 && P > 1) weights[1] = 0;
  const auto sp = tpnorm_test::split_weighted(c.hidden, weights);
  auto round = [&](std::vector<float> v) { return Buffer(dt, v).floats(); };
  Shard s;
  s.full.rows = c.rows;
  s.full.h = c.hidden;
  s.full.dtype = dt;
  s.full.x = round(tpnorm_test::normal(11, 0, c.rows * c.hidden, 0.5, 1.5));
  s.full.dy = round(tpnorm_test::normal(11, 1, c.rows * c.hidden));
  s.full.gamma = round(tpnorm_test::normal(11, 2, c.hidden, 1.0, 0.5));
  s.full.beta = round(tpnorm_test::normal(11, 3, c.hidden));
  s.c0 = sp.offset[me];
  const int64_t h = sp.count[me];
  s.in = s.full;
  s.in.h = h;
  s.in.x = tpnorm_test::columns(s.full.x, c.rows, c.hidden, s.c0, h);
  s.in.dy = tpnorm_test::columns(s.full.dy, c.rows, c.hidden, s.c0, h);
  s.in.gamma = tpnorm_test::columns(s.full.gamma, 1, c.hidden, s.c0, h);
  s.in.beta = tpnorm_test::columns(s.full.beta, 1, c.hidden, s.c0, h);
  return s;
}

using Param = std::tuple<Case, bool, DType, Kind>;
class GpuRowNormRanks : public ::testing::TestWithParam<Param> {};

TEST_P(GpuRowNormRanks, MatchesReferenceAndCpuShards) {
  TPNORM_REQUIRE_GPU();
  const auto [c, centered, dt, kind] = GetParam();
  cudaStream_t s = nullptr;
  std::string skip;
  auto gpu = make_comm(kind, &s, &skip);
  if (!gpu) GTEST_SKIP() << skip;
  const Shard sh = make_shard(c, dt);
  gpu->reset_counters();
  const RowOut got = run_rows(*gpu, centered, sh.in, gpu->device().index);
  EXPECT_EQ(gpu->counters().calls, 2u) << "one device collective per forward and backward";
  EXPECT_NO_THROW(cuda_check_errors(*gpu));
  auto cpu_comm = make_mpi_communicator(MPI_COMM_WORLD);
  const RowOut cpu = run_rows(*cpu_comm, centered, sh.in, -1);
  const auto ref = tpnorm_test::row_norm_reference(
      centered, sh.full.x, c.rows, c.hidden, sh.full.gamma,
      centered ? sh.full.beta : std::vector<float>{}, 1e-5, sh.full.dy);
  const int64_t wrong =
      count_wrong_rows(got, cpu, ref, centered, dt, c.rows, c.hidden, sh.c0, sh.in.h);
  EXPECT_EQ(tpnorm_test::sum_over_ranks(wrong), 0) << "elements out of tolerance, all ranks";
  gpu.reset();
  cudaStreamDestroy(s);
}

const Case kCases[] = {
    {"r64_h1000", 64, 1000},
    {"r17_h33_zero_on_rank1", 17, 33, true},
    {"r5_h3", 5, 3},  // at 4 ranks one rank has no column
    {"r4_h5000", 4, 5000},
};

std::string name(const ::testing::TestParamInfo<Param>& i) {
  return std::string(std::get<1>(i.param) ? "LayerNorm_" : "RMSNorm_") + std::get<0>(i.param).name +
         "_" + dtype_name(std::get<2>(i.param)) +
         (std::get<3>(i.param) == Kind::kNccl ? "_nccl" : "_staged");
}

INSTANTIATE_TEST_SUITE_P(Staged, GpuRowNormRanks,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Bool(),
                                            ::testing::Values(DType::F32, DType::F16, DType::BF16),
                                            ::testing::Values(Kind::kStaged)),
                         name);
INSTANTIATE_TEST_SUITE_P(Nccl, GpuRowNormRanks,
                         ::testing::Combine(::testing::Values(kCases[0], kCases[3]),
                                            ::testing::Bool(),
                                            ::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Values(Kind::kNccl)),
                         name);

// eps differs on the last rank. Strict calls: every rank throws the same error from the host
// check. Later calls: no rank throws, the device check leaves every output untouched, and
// cuda_check_errors reports it on every rank.
TEST(GpuRowNormRanksErrors, DisagreementIsCaughtOnHostThenOnDevice) {
  TPNORM_REQUIRE_GPU();
  const int P = tpnorm_test::world_size(), me = tpnorm_test::world_rank();
  if (P < 2) GTEST_SKIP() << "needs 2 ranks";
  cudaStream_t s = nullptr;
  std::string skip;
  auto gpu = make_comm(Kind::kStaged, &s, &skip);
  const int64_t R = 6, h = 40;
  const Shape sh{R, h}, r{R};
  const int dev = gpu->device().index;
  DevBuf x(Buffer(DType::F32, tpnorm_test::normal(3, me, R * h)), false, dev),
      y(Buffer(DType::F32, std::vector<float>(R * h, 42.f)), false, dev),
      mean(Buffer(DType::F32, R), false, dev), rstd(Buffer(DType::F32, R), false, dev);
  NormOptions opt;
  opt.eps = me == P - 1 ? 1e-3 : 1e-5;
  int64_t bad = 0;
  std::string msg;
  try {
    layer_norm_forward(*gpu, x.view(sh), {}, {}, y.view(sh), mean.view(r), rstd.view(r), opt);
    ++bad;
  } catch (const Error& e) {
    msg = e.what();
    if (!std::strstr(e.what(), "eps")) ++bad;
  }
  gpu->set_strict_calls(0);
  try {
    layer_norm_forward(*gpu, x.view(sh), {}, {}, y.view(sh), mean.view(r), rstd.view(r), opt);
  } catch (const Error& e) {
    ++bad;  // after the strict calls nobody throws from the call itself
  }
  bool reported = false;
  try {
    cuda_check_errors(*gpu);
  } catch (const Error& e) {
    reported = e.code() == ErrorCode::kMismatch;
  }
  if (!reported) ++bad;
  for (float v : y.floats()) bad += v != 42.f;
  EXPECT_EQ(tpnorm_test::sum_over_ranks(bad), 0) << "rank " << me << ": " << msg;
  gpu.reset();
  cudaStreamDestroy(s);
}

// NCCL: forward + backward captured in a CUDA graph (collective included) and replayed.
TEST(GpuRowNormRanksGraph, NcclCaptureAndReplayMatchesCpu) {
  TPNORM_REQUIRE_GPU();
  cudaStream_t s = nullptr;
  std::string skip;
  auto gpu = make_comm(Kind::kNccl, &s, &skip);
  if (!gpu) GTEST_SKIP() << skip;
  gpu->set_strict_calls(0);
  const Case c{"graph", 24, 3000};
  const Shard sh = make_shard(c, DType::F32);
  const int64_t R = c.rows, h = sh.in.h;
  const Shape sx{R, h}, p{h}, r{R};
  const int dev = gpu->device().index;
  DevBuf x(Buffer(DType::F32, sh.in.x), false, dev), dy(Buffer(DType::F32, sh.in.dy), false, dev),
      g(Buffer(DType::F32, sh.in.gamma), false, dev), y(Buffer(DType::F32, R * h), false, dev),
      dx(Buffer(DType::F32, R * h), false, dev), dg(Buffer(DType::F32, h), false, dev),
      rstd(Buffer(DType::F32, R), false, dev);
  auto call = [&] {
    rms_norm_forward(*gpu, x.view(sx), g.view(p), y.view(sx), rstd.view(r));
    rms_norm_backward(*gpu, dy.view(sx), x.view(sx), g.view(p), rstd.view(r), dx.view(sx),
                      dg.view(p));
  };
  call();
  cudaStreamSynchronize(s);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TPNORM_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  call();
  TPNORM_CUDA_OK(cudaStreamEndCapture(s, &graph));
  TPNORM_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  Buffer zeros(DType::F32, R * h);
  y.upload(zeros, s);
  dx.upload(zeros, s);
  TPNORM_CUDA_OK(cudaGraphLaunch(exec, s));
  TPNORM_CUDA_OK(cudaStreamSynchronize(s));
  const RowOut got{y.floats(), {}, rstd.floats(), dx.floats(), dg.floats(), {}};
  auto cpu_comm = make_mpi_communicator(MPI_COMM_WORLD);
  RowIn in = sh.in;
  in.beta.clear();
  const RowOut cpu = run_rows(*cpu_comm, false, in, -1);
  const auto ref = tpnorm_test::row_norm_reference(false, sh.full.x, R, c.hidden, sh.full.gamma, {},
                                                   1e-5, sh.full.dy);
  const int64_t wrong = count_wrong_rows(got, cpu, ref, false, DType::F32, R, c.hidden, sh.c0, h);
  EXPECT_EQ(tpnorm_test::sum_over_ranks(wrong), 0);
  EXPECT_NO_THROW(cuda_check_errors(*gpu));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  gpu.reset();
  cudaStreamDestroy(s);
}

}  // namespace
