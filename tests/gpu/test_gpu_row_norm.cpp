// One GPU, one process: the CUDA LayerNorm / RMSNorm kernels (through the ops, on a
// single-GPU communicator) against the float64 reference and the CPU kernels, element by
// element (tolerances in gpu_checks.h); both the 16-byte vector path and the scalar path
// (buffers shifted by one element); a warp per row (h <= 1024) and a block per row; fp32,
// fp16, bf16; CUDA graph capture and replay; argument errors. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cstring>

#include "gpu_checks.h"
#include "tpnorm/cuda.h"
#include "tpnorm/error.h"

using namespace tpnorm;
using namespace tpnorm_gpu;
using tpnorm_test::Buffer;

namespace {

struct Case {
  const char* name;
  int64_t rows, hidden;
  double offset = 0.0;
  DType saved = DType::F32;
  Stats stats = Stats::kRobust;
};

RowIn make_input(const Case& c, bool affine, DType dt) {
  auto round = [&](std::vector<float> v) { return Buffer(dt, v).floats(); };
  RowIn in;
  in.rows = c.rows;
  in.h = c.hidden;
  in.dtype = dt;
  in.saved = c.saved;
  in.x = round(tpnorm_test::normal(7, 0, c.rows * c.hidden, c.offset, 1.5));
  in.dy = round(tpnorm_test::normal(7, 1, c.rows * c.hidden));
  if (affine) {
    in.gamma = round(tpnorm_test::normal(7, 2, c.hidden, 1.0, 0.5));
    in.beta = round(tpnorm_test::normal(7, 3, c.hidden));
  }
  return in;
}

using Param = std::tuple<Case, bool, bool, DType, bool>;  // case, centered, affine, dtype, misalign
class GpuRowNorm : public ::testing::TestWithParam<Param> {};

TEST_P(GpuRowNorm, MatchesReferenceAndCpuKernels) {
  TPNORM_REQUIRE_GPU();
  const auto [c, centered, affine, dt, misalign] = GetParam();
  const RowIn in = make_input(c, affine, dt);
  NormOptions opt;
  opt.stats = c.stats;
  cudaStream_t s = nullptr;
  TPNORM_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  RowOut got;
  {
    auto gpu = make_cuda_single_communicator(s, 0);
    got = run_rows(*gpu, centered, in, 0, misalign, opt);
    EXPECT_NO_THROW(cuda_check_errors(*gpu));
  }
  cudaStreamDestroy(s);
  auto cpu_comm = make_single_communicator();
  const RowOut cpu = run_rows(*cpu_comm, centered, in, -1, false, opt);
  const auto ref = tpnorm_test::row_norm_reference(
      centered, in.x, c.rows, c.hidden, in.gamma, centered ? in.beta : std::vector<float>{},
      1e-5, in.dy);
  EXPECT_EQ(count_wrong_rows(got, cpu, ref, centered, dt, c.rows, c.hidden, 0, c.hidden), 0);
}

const Case kCases[] = {
    {"r71_h229", 71, 229},                   // warp per row, odd h: scalar path
    {"r29_h541", 29, 541},
    {"r64_h1024", 64, 1024},                 // warp per row, vector path when aligned
    {"r3_h4096", 3, 4096},                   // block per row, vector path
    {"r7_h1030", 7, 1030},                   // block per row, h not a multiple of the pack
    {"r1_h1", 1, 1},
    {"r300_h40", 300, 40},                   // many rows: multi-chunk dgamma reduction
    {"r8_h1000_offset1e4", 8, 1000, 1e4, DType::F64},
};

std::string name(const ::testing::TestParamInfo<Param>& i) {
  return std::string(std::get<1>(i.param) ? "LayerNorm_" : "RMSNorm_") +
         std::get<0>(i.param).name + (std::get<2>(i.param) ? "_affine_" : "_plain_") +
         dtype_name(std::get<3>(i.param)) + (std::get<4>(i.param) ? "_scalar" : "_aligned");
}

INSTANTIATE_TEST_SUITE_P(Fp32, GpuRowNorm,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Bool(),
                                            ::testing::Bool(), ::testing::Values(DType::F32),
                                            ::testing::Bool()),
                         name);
INSTANTIATE_TEST_SUITE_P(Half, GpuRowNorm,
                         ::testing::Combine(::testing::Values(kCases[1], kCases[2], kCases[3],
                                                              kCases[4]),
                                            ::testing::Bool(), ::testing::Values(true),
                                            ::testing::Values(DType::F16, DType::BF16),
                                            ::testing::Bool()),
                         name);
const Case kNaive[] = {{"r33_h777_naive", 33, 777, 0.0, DType::F32, Stats::kNaive},
                       {"r2_h2048_naive", 2, 2048, 0.0, DType::F32, Stats::kNaive}};
INSTANTIATE_TEST_SUITE_P(Naive, GpuRowNorm,
                         ::testing::Combine(::testing::ValuesIn(kNaive), ::testing::Bool(),
                                            ::testing::Values(true), ::testing::Values(DType::F32),
                                            ::testing::Values(false)),
                         name);

// Forward + backward captured once in a CUDA graph and replayed on new inputs copied into the
// same buffers: every replay must match the CPU op on that replay's inputs.
TEST(GpuRowNormGraph, CaptureAndReplayMatchesCpu) {
  TPNORM_REQUIRE_GPU();
  const int64_t R = 37, h = 1536;
  const Shape s{R, h}, p{h}, r{R};
  cudaStream_t st = nullptr;
  TPNORM_CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  auto gpu = make_cuda_single_communicator(st, 0);
  gpu->set_strict_calls(0);  // no host-side pre-check: nothing in the call touches the host
  Case c{"graph", R, h};
  RowIn in = make_input(c, true, DType::BF16);
  DevBuf x(Buffer(in.dtype, in.x)), dy(Buffer(in.dtype, in.dy)), g(Buffer(in.dtype, in.gamma)),
      b(Buffer(in.dtype, in.beta)), y(Buffer(in.dtype, R * h)), dx(Buffer(in.dtype, R * h)),
      dg(Buffer(in.dtype, h)), db(Buffer(in.dtype, h)), mean(Buffer(DType::F32, R)),
      rstd(Buffer(DType::F32, R));
  auto call = [&] {
    layer_norm_forward(*gpu, x.view(s), g.view(p), b.view(p), y.view(s), mean.view(r),
                       rstd.view(r));
    layer_norm_backward(*gpu, dy.view(s), x.view(s), g.view(p), mean.view(r), rstd.view(r),
                        dx.view(s), dg.view(p), db.view(p));
  };
  call();  // grows the workspace outside the capture
  TPNORM_CUDA_OK(cudaStreamSynchronize(st));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TPNORM_CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  call();
  TPNORM_CUDA_OK(cudaStreamEndCapture(st, &graph));
  TPNORM_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  auto cpu_comm = make_single_communicator();
  for (uint64_t rep = 0; rep < 3; ++rep) {
    in.x = Buffer(in.dtype, tpnorm_test::normal(100 + rep, 0, R * h, 0.5 * rep, 1.0 + rep)).floats();
    in.dy = Buffer(in.dtype, tpnorm_test::normal(100 + rep, 1, R * h)).floats();
    x.upload(Buffer(in.dtype, in.x), st);
    dy.upload(Buffer(in.dtype, in.dy), st);
    TPNORM_CUDA_OK(cudaGraphLaunch(exec, st));
    TPNORM_CUDA_OK(cudaStreamSynchronize(st));
    const RowOut got{y.floats(), mean.floats(), rstd.floats(), dx.floats(), dg.floats(),
                     db.floats()};
    const RowOut cpu = run_rows(*cpu_comm, true, in, -1);
    const auto ref = tpnorm_test::row_norm_reference(true, in.x, R, h, in.gamma, in.beta, 1e-5,
                                                     in.dy);
    EXPECT_EQ(count_wrong_rows(got, cpu, ref, true, in.dtype, R, h, 0, h), 0) << "replay " << rep;
  }
  EXPECT_NO_THROW(cuda_check_errors(*gpu));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  gpu.reset();
  cudaStreamDestroy(st);
}

// A bad argument throws (strict: checked on the host before any device work; not strict: the
// rank joins the collective, then throws) and leaves the outputs untouched.
TEST(GpuRowNormErrors, BadArgumentThrowsAndLeavesOutputs) {
  TPNORM_REQUIRE_GPU();
  const int64_t R = 4, h = 64;
  const Shape s{R, h}, r{R};
  for (int64_t strict : {-1, 0}) {
    auto gpu = make_cuda_single_communicator(nullptr, 0);
    gpu->set_strict_calls(strict);
    DevBuf x(Buffer(DType::F32, tpnorm_test::normal(1, 0, R * h))),
        y(Buffer(DType::F32, std::vector<float>(R * h, 42.f))), mean(Buffer(DType::F32, R)),
        rstd(Buffer(DType::F32, R));
    NormOptions opt;
    opt.eps = -1;
    try {
      layer_norm_forward(*gpu, x.view(s), {}, {}, y.view(s), mean.view(r), rstd.view(r), opt);
      ADD_FAILURE() << "no error with eps = -1 (strict " << strict << ")";
    } catch (const Error& e) {
      EXPECT_NE(std::strstr(e.what(), "eps"), nullptr) << e.what();
    }
    cudaDeviceSynchronize();
    for (float v : y.floats()) ASSERT_EQ(v, 42.f) << "strict " << strict;
  }
  // A CUDA view on a host communicator, and a CUDA communicator without a stream.
  auto host = make_single_communicator();
  auto bare = make_single_communicator(Device::cuda(0));
  DevBuf x(Buffer(DType::F32, R * h)), y(Buffer(DType::F32, R * h));
  EXPECT_THROW(rms_norm_forward(*host, x.view(s), {}, y.view(s), {}), Error);
  EXPECT_THROW(rms_norm_forward(*bare, x.view(s), {}, y.view(s), {}), Error);
}

}  // namespace
