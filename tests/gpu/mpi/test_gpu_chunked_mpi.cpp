// Chunked device calls (ops/chunking.h, src/ops/cuda/row_chunks_cuda.*) under mpiexec on the
// visible GPUs, with TPNORM_CHUNK forcing chunks of a few rows: the LayerNorm / RMSNorm forward
// and backward run chunk by chunk (partial kernels on the caller's stream, each chunk's
// all-reduce on the NCCL communicator's side stream ordered by events; the backward's chunks add
// their dgamma / dbeta column sums into the same scratch slices, added up once after the last
// chunk). Each rank's shard (y, mean, rstd, dx, dgamma, dbeta) must match the float64 reference
// on the full data and the CPU op (unchunked) element by element; the counters show one device
// collective per chunk of each pass; a chunked backward repeated gives the same bits; with NCCL
// the chunked forward is also captured in a CUDA graph and replayed. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "gpu_checks.h"
#include "tpnorm/cuda_mpi.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_gpu;
using tpnorm_test::Buffer;

namespace {

enum class Kind { kStaged, kNccl };

// TPNORM_CHUNK for the scope, the same on every rank.
struct ChunkEnv {
  explicit ChunkEnv(const char* v) { setenv("TPNORM_CHUNK", v, 1); }
  ~ChunkEnv() { unsetenv("TPNORM_CHUNK"); }
};

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

struct Case {
  const char* name;
  int64_t rows, hidden, chunk_rows;
  bool zero_on_rank1 = false;
};

struct Shard {
  RowIn in, full;
  int64_t c0 = 0;
};

Shard make_shard(const Case& c, DType dt) {
  const int P = tpnorm_test::world_size(), me = tpnorm_test::world_rank();
  std::vector<int> weights(P, 2);
  weights[0] = 3;  // uneven
  if (c.zero_on_rank1 && P > 1) weights[1] = 0;
  const auto sp = tpnorm_test::split_weighted(c.hidden, weights);
  auto round = [&](std::vector<float> v) { return Buffer(dt, v).floats(); };
  Shard s;
  s.full.rows = c.rows;
  s.full.h = c.hidden;
  s.full.dtype = dt;
  s.full.x = round(tpnorm_test::normal(21, 0, c.rows * c.hidden, 0.5, 1.5));
  s.full.dy = round(tpnorm_test::normal(21, 1, c.rows * c.hidden));
  s.full.gamma = round(tpnorm_test::normal(21, 2, c.hidden, 1.0, 0.5));
  s.full.beta = round(tpnorm_test::normal(21, 3, c.hidden));
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
class GpuChunked : public ::testing::TestWithParam<Param> {};

TEST_P(GpuChunked, ForcedChunksMatchReferenceAndCpu) {
  TPNORM_REQUIRE_GPU();
  const auto [c, centered, dt, kind] = GetParam();
  cudaStream_t s = nullptr;
  std::string skip;
  auto gpu = make_comm(kind, &s, &skip);
  if (!gpu) GTEST_SKIP() << skip;
  const Shard sh = make_shard(c, dt);
  RowOut got;
  {
    ChunkEnv e(std::to_string(c.chunk_rows).c_str());
    gpu->reset_counters();
    got = run_rows(*gpu, centered, sh.in, gpu->device().index);
  }
  const int64_t k = (c.rows + c.chunk_rows - 1) / c.chunk_rows;
  EXPECT_EQ(gpu->counters().calls, static_cast<uint64_t>(2 * k))
      << "one device collective per chunk, forward and backward";
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
    {"r64_h1000_c16", 64, 1000, 16},
    {"r37_h33_c8_zero_on_rank1", 37, 33, 8, true},  // rows not a multiple of the chunk
    {"r1_h500_c4", 1, 500, 4},                      // one row: not chunked
    {"r300_h4096_c128", 300, 4096, 128},
    // Backward column sums: block per row, odd h, 5 chunks, the last one (44 rows) with fewer
    // column-sum blocks than chunk 0 (row_bwd_parts 64 then 44).
    {"r300_h1025_c64_zero_on_rank1", 300, 1025, 64, true},
    // Warp per row, many rows per block: chunk 0 and 1 have 128 column-sum blocks, the last
    // (952 rows) 119.
    {"r3000_h40_c1024", 3000, 40, 1024},
};

std::string name(const ::testing::TestParamInfo<Param>& i) {
  return std::string(std::get<1>(i.param) ? "LayerNorm_" : "RMSNorm_") + std::get<0>(i.param).name +
         "_" + dtype_name(std::get<2>(i.param)) +
         (std::get<3>(i.param) == Kind::kNccl ? "_nccl" : "_staged");
}

INSTANTIATE_TEST_SUITE_P(Staged, GpuChunked,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Bool(),
                                            ::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Values(Kind::kStaged)),
                         name);
INSTANTIATE_TEST_SUITE_P(Nccl, GpuChunked,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Bool(),
                                            ::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Values(Kind::kNccl)),
                         name);

// A chunked backward is deterministic for a given shape and plan: the same call twice gives the
// same dx, dgamma and dbeta bits (chunk 0 writes the column-sum slices, later chunks add to them
// in chunk order; one pass adds the slices in block order).
TEST(GpuChunkedBackward, RepeatedCallGivesTheSameBits) {
  TPNORM_REQUIRE_GPU();
  cudaStream_t s = nullptr;
  std::string skip;
  auto gpu = make_comm(Kind::kStaged, &s, &skip);
  if (!gpu) GTEST_SKIP() << skip;
  ChunkEnv e("64");
  const Case c{"det", 300, 1025, 64};
  const Shard sh = make_shard(c, DType::F32);
  const RowOut a = run_rows(*gpu, true, sh.in, gpu->device().index);
  const RowOut b = run_rows(*gpu, true, sh.in, gpu->device().index);
  EXPECT_NO_THROW(cuda_check_errors(*gpu));
  int64_t differ = 0;
  const std::pair<const std::vector<float>*, const std::vector<float>*> outs[] = {
      {&a.dx, &b.dx}, {&a.dgamma, &b.dgamma}, {&a.dbeta, &b.dbeta}};
  for (const auto& [u, v] : outs) {
    EXPECT_EQ(u->size(), v->size());
    for (size_t i = 0; i < u->size() && i < v->size(); ++i)
      differ += std::memcmp(&(*u)[i], &(*v)[i], sizeof(float)) != 0;
  }
  EXPECT_EQ(tpnorm_test::sum_over_ranks(differ), 0) << "bits that differ between two calls";
  gpu.reset();
  cudaStreamDestroy(s);
}

// NCCL: a chunked forward captured in a CUDA graph (the side stream forks from the caller's
// stream and joins it again inside the capture) and replayed: the CPU op's values.
TEST(GpuChunkedGraph, NcclChunkedForwardCaptureAndReplay) {
  TPNORM_REQUIRE_GPU();
  cudaStream_t s = nullptr;
  std::string skip;
  auto gpu = make_comm(Kind::kNccl, &s, &skip);
  if (!gpu) GTEST_SKIP() << skip;
  ChunkEnv e("8");
  const Case c{"graph", 40, 3000, 8};
  const Shard sh = make_shard(c, DType::F32);
  const int64_t R = c.rows, h = sh.in.h;
  const Shape sx{R, h}, p{h}, r{R};
  const int dev = gpu->device().index;
  DevBuf x(Buffer(DType::F32, sh.in.x), false, dev), g(Buffer(DType::F32, sh.in.gamma), false, dev),
      y(Buffer(DType::F32, R * h), false, dev), rstd(Buffer(DType::F32, R), false, dev);
  auto call = [&] { rms_norm_forward(*gpu, x.view(sx), g.view(p), y.view(sx), rstd.view(r)); };
  call();
  cudaStreamSynchronize(s);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TPNORM_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  call();
  TPNORM_CUDA_OK(cudaStreamEndCapture(s, &graph));
  TPNORM_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  y.upload(Buffer(DType::F32, R * h), s);
  TPNORM_CUDA_OK(cudaGraphLaunch(exec, s));
  TPNORM_CUDA_OK(cudaStreamSynchronize(s));
  const auto ref = tpnorm_test::row_norm_reference(false, sh.full.x, R, c.hidden, sh.full.gamma,
                                                   {}, 1e-5);
  int64_t wrong = tpnorm_test::count_wrong("y", y.floats(), ref_cols(ref.y, R, c.hidden, sh.c0, h),
                                           1e-5, 1e-5) +
                  tpnorm_test::count_wrong("rstd", rstd.floats(), ref.rstd, 0, 1e-6);
  EXPECT_NO_THROW(cuda_check_errors(*gpu));
  EXPECT_EQ(tpnorm_test::sum_over_ranks(wrong), 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  gpu.reset();
  cudaStreamDestroy(s);
}

}  // namespace
