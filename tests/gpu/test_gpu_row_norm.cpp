// One GPU, one process: the CUDA LayerNorm / RMSNorm kernels (through the ops, on a
// single-GPU communicator) against the float64 reference and the CPU kernels, element by
// element (tolerances in gpu_checks.h); both the 16-byte vector path and the scalar path
// (buffers shifted by one element); a warp per row (h <= 1024) and a block per row; fp32,
// fp16, bf16; CUDA graph capture and replay; argument errors. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
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
  const auto ref =
      tpnorm_test::row_norm_reference(centered, in.x, c.rows, c.hidden, in.gamma,
                                      centered ? in.beta : std::vector<float>{}, 1e-5, in.dy);
  EXPECT_EQ(count_wrong_rows(got, cpu, ref, centered, dt, c.rows, c.hidden, 0, c.hidden), 0);
}

const Case kCases[] = {
    {"r71_h229", 71, 229},  // warp per row, odd h: scalar path
    {"r29_h541", 29, 541},
    {"r64_h1024", 64, 1024},  // warp per row, vector path when aligned
    {"r3_h4096", 3, 4096},    // block per row, vector path
    {"r7_h1030", 7, 1030},    // block per row, h not a multiple of the pack
    {"r1_h1", 1, 1},
    {"r300_h40", 300, 40},  // many rows: 38 blocks' dgamma column sums (plan.h row_bwd_parts)
    {"r8_h1000_offset1e4", 8, 1000, 1e4, DType::F64},
};

std::string name(const ::testing::TestParamInfo<Param>& i) {
  return std::string(std::get<1>(i.param) ? "LayerNorm_" : "RMSNorm_") + std::get<0>(i.param).name +
         (std::get<2>(i.param) ? "_affine_" : "_plain_") + dtype_name(std::get<3>(i.param)) +
         (std::get<4>(i.param) ? "_scalar" : "_aligned");
}

INSTANTIATE_TEST_SUITE_P(Fp32, GpuRowNorm,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Bool(),
                                            ::testing::Bool(), ::testing::Values(DType::F32),
                                            ::testing::Bool()),
                         name);
INSTANTIATE_TEST_SUITE_P(
    Half, GpuRowNorm,
    ::testing::Combine(::testing::Values(kCases[1], kCases[2], kCases[3], kCases[4]),
                       ::testing::Bool(), ::testing::Values(true),
                       ::testing::Values(DType::F16, DType::BF16), ::testing::Bool()),
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
    in.x =
        Buffer(in.dtype, tpnorm_test::normal(100 + rep, 0, R * h, 0.5 * rep, 1.0 + rep)).floats();
    in.dy = Buffer(in.dtype, tpnorm_test::normal(100 + rep, 1, R * h)).floats();
    x.upload(Buffer(in.dtype, in.x), st);
    dy.upload(Buffer(in.dtype, in.dy), st);
    TPNORM_CUDA_OK(cudaGraphLaunch(exec, st));
    TPNORM_CUDA_OK(cudaStreamSynchronize(st));
    const RowOut got{y.floats(),  mean.floats(), rstd.floats(),
                     dx.floats(), dg.floats(),   db.floats()};
    const RowOut cpu = run_rows(*cpu_comm, true, in, -1);
    const auto ref =
        tpnorm_test::row_norm_reference(true, in.x, R, h, in.gamma, in.beta, 1e-5, in.dy);
    EXPECT_EQ(count_wrong_rows(got, cpu, ref, true, in.dtype, R, h, 0, h), 0) << "replay " << rep;
  }
  EXPECT_NO_THROW(cuda_check_errors(*gpu));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  gpu.reset();
  cudaStreamDestroy(st);
}

// A graph captured at one shape, then an eager call whose larger shape grows the workspace,
// then the graph replayed: the replay must still use live memory (the workspace keeps the
// block the graph was captured with; run under compute-sanitizer memcheck by gpu-check, a
// replay into freed memory is an error there) and match the CPU op.
TEST(GpuRowNormGraph, ReplayAfterWorkspaceGrowthMatchesCpu) {
  TPNORM_REQUIRE_GPU();
  cudaStream_t st = nullptr;
  TPNORM_CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  auto gpu = make_cuda_single_communicator(st, 0);
  gpu->set_strict_calls(0);
  auto cpu_comm = make_single_communicator();
  struct Io {
    RowIn in;
    DevBuf x, dy, g, b, y, dx, dg, db, mean, rstd;
    explicit Io(const RowIn& i)
        : in(i),
          x(Buffer(i.dtype, i.x)),
          dy(Buffer(i.dtype, i.dy)),
          g(Buffer(i.dtype, i.gamma)),
          b(Buffer(i.dtype, i.beta)),
          y(Buffer(i.dtype, i.rows * i.h)),
          dx(Buffer(i.dtype, i.rows * i.h)),
          dg(Buffer(i.dtype, i.h)),
          db(Buffer(i.dtype, i.h)),
          mean(Buffer(DType::F32, i.rows)),
          rstd(Buffer(DType::F32, i.rows)) {}
    void call(Communicator& c) {
      const Shape s{in.rows, in.h}, p{in.h}, r{in.rows};
      layer_norm_forward(c, x.view(s), g.view(p), b.view(p), y.view(s), mean.view(r), rstd.view(r));
      layer_norm_backward(c, dy.view(s), x.view(s), g.view(p), mean.view(r), rstd.view(r),
                          dx.view(s), dg.view(p), db.view(p));
    }
    int64_t wrong(Communicator& cpu) {
      const RowOut got{y.floats(),  mean.floats(), rstd.floats(),
                       dx.floats(), dg.floats(),   db.floats()};
      const RowOut want = run_rows(cpu, true, in, -1);
      const auto ref = tpnorm_test::row_norm_reference(true, in.x, in.rows, in.h, in.gamma, in.beta,
                                                       1e-5, in.dy);
      return count_wrong_rows(got, want, ref, true, in.dtype, in.rows, in.h, 0, in.h);
    }
  };
  Io small(make_input(Case{"small", 37, 1536}, true, DType::F32));
  small.call(*gpu);  // sizes the workspace for the small shape only
  TPNORM_CUDA_OK(cudaStreamSynchronize(st));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TPNORM_CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  small.call(*gpu);
  TPNORM_CUDA_OK(cudaStreamEndCapture(st, &graph));
  TPNORM_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  // 8192 rows: 128 KiB of float64 row sums, more than the small call's 64 KiB workspace.
  Io large(make_input(Case{"large", 8192, 256}, true, DType::F32));
  large.call(*gpu);
  TPNORM_CUDA_OK(cudaStreamSynchronize(st));
  EXPECT_EQ(large.wrong(*cpu_comm), 0) << "the eager call that grew the workspace";
  Buffer zeros(DType::F32, small.in.rows * small.in.h);
  small.y.upload(zeros, st);
  small.dx.upload(zeros, st);
  TPNORM_CUDA_OK(cudaGraphLaunch(exec, st));
  TPNORM_CUDA_OK(cudaStreamSynchronize(st));
  EXPECT_EQ(small.wrong(*cpu_comm), 0) << "the replay after the growth";
  EXPECT_NO_THROW(cuda_check_errors(*gpu));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  gpu.reset();
  cudaStreamDestroy(st);
}

// One LayerNorm forward + backward over more than 2^31 elements (2^21 + 3 rows of 1024, bf16):
// every index is 64-bit. The input repeats a tile of kTile seeded rows, so spot rows (the
// first, around element 2^31, the last) are checked against the CPU op on their tile row,
// and dgamma/dbeta against the tile's sums times each tile row's multiplicity.
TEST(GpuRowNormHuge, MoreThan2Pow31ElementsSpotChecked) {
  TPNORM_REQUIRE_GPU();
  if (!std::getenv("TPNORM_GPU_HUGE"))
    GTEST_SKIP() << "17 GiB of device memory: set TPNORM_GPU_HUGE=1";
  const int64_t R = (int64_t{1} << 21) + 3, h = 1024, kTile = 4096;
  const DType dt = DType::BF16;
  const size_t bytes = static_cast<size_t>(R * h) * dtype_size(dt);
  size_t free_b = 0, total_b = 0;
  TPNORM_CUDA_OK(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < 4 * bytes + (size_t{1} << 30))
    GTEST_SKIP() << "needs " << (4 * bytes >> 30) << " GiB of free device memory, has "
                 << (free_b >> 30);
  RowIn tile = make_input(Case{"tile", kTile, h}, true, dt);
  const Buffer tx(dt, tile.x), tdy(dt, tile.dy);
  void *x = nullptr, *dy = nullptr, *y = nullptr, *dx = nullptr;
  for (void** p : {&x, &dy, &y, &dx}) TPNORM_CUDA_OK(cudaMalloc(p, bytes));
  Buffer htx = tx, htdy = tdy;  // view() needs non-const buffers
  for (int64_t r0 = 0; r0 < R; r0 += kTile) {
    const size_t n = static_cast<size_t>(std::min(kTile, R - r0) * h) * dtype_size(dt);
    const size_t at = static_cast<size_t>(r0 * h) * dtype_size(dt);
    TPNORM_CUDA_OK(cudaMemcpy(static_cast<char*>(x) + at, htx.view(Shape{kTile * h}).data, n,
                              cudaMemcpyHostToDevice));
    TPNORM_CUDA_OK(cudaMemcpy(static_cast<char*>(dy) + at, htdy.view(Shape{kTile * h}).data, n,
                              cudaMemcpyHostToDevice));
  }
  TPNORM_CUDA_OK(cudaMemset(y, 0xff, bytes));  // NaN: a row never written shows
  TPNORM_CUDA_OK(cudaMemset(dx, 0xff, bytes));
  DevBuf g(Buffer(dt, tile.gamma)), b(Buffer(dt, tile.beta)), dg(Buffer(dt, h)), db(Buffer(dt, h)),
      mean(Buffer(DType::F32, R)), rstd(Buffer(DType::F32, R));
  auto gpu = make_cuda_single_communicator(nullptr, 0);
  const Shape s{R, h}, p{h}, r{R};
  const Device d = Device::cuda(0);
  layer_norm_forward(*gpu, {x, dt, s, d}, g.view(p), b.view(p), {y, dt, s, d}, mean.view(r),
                     rstd.view(r));
  layer_norm_backward(*gpu, {dy, dt, s, d}, {x, dt, s, d}, g.view(p), mean.view(r), rstd.view(r),
                      {dx, dt, s, d}, dg.view(p), db.view(p));
  TPNORM_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_NO_THROW(cuda_check_errors(*gpu));
  auto cpu_comm = make_single_communicator();
  const RowOut cpu = run_rows(*cpu_comm, true, tile, -1);
  const std::vector<float> got_mean = mean.floats(), got_rstd = rstd.floats();
  const double rt = tpnorm_test::storage_rtol(dt);
  int64_t wrong = 0;
  const int64_t boundary = (int64_t{1} << 31) / h;  // first row past element 2^31
  for (int64_t row : {int64_t{0}, int64_t{1}, boundary - 1, boundary, boundary + 1,
                      int64_t{1} << 20, R - 2, R - 1}) {
    const int64_t t = row % kTile;
    Buffer yr(dt, h), dxr(dt, h);
    const size_t at = static_cast<size_t>(row * h) * dtype_size(dt);
    const size_t n = static_cast<size_t>(h) * dtype_size(dt);
    TPNORM_CUDA_OK(
        cudaMemcpy(yr.view(Shape{h}).data, static_cast<char*>(y) + at, n, cudaMemcpyDeviceToHost));
    TPNORM_CUDA_OK(cudaMemcpy(dxr.view(Shape{h}).data, static_cast<char*>(dx) + at, n,
                              cudaMemcpyDeviceToHost));
    const std::vector<float> gy = yr.floats(), gdx = dxr.floats();
    for (int64_t j = 0; j < h; ++j) {
      const double wy = cpu.y[t * h + j], wdx = cpu.dx[t * h + j];
      wrong += !(std::abs(gy[j] - wy) <= rt + rt * std::abs(wy));
      wrong += !(std::abs(gdx[j] - wdx) <= 10 * rt * (1 + std::abs(wdx)));
    }
    wrong += !(std::abs(got_mean[row] - cpu.mean[t]) <= 1e-6 * (1 + std::abs(cpu.mean[t])));
    wrong += !(std::abs(got_rstd[row] - cpu.rstd[t]) <= 1e-6 * std::abs(cpu.rstd[t]));
    EXPECT_EQ(wrong, 0) << "row " << row << " (tile row " << t << ")";
  }
  // dgamma / dbeta: tile row t occurs R / kTile times, once more when t < R % kTile.
  std::vector<double> wg(h, 0.0), wb(h, 0.0);
  for (int64_t t = 0; t < kTile; ++t) {
    const double times = static_cast<double>(R / kTile + (t < R % kTile ? 1 : 0));
    const double mu = cpu.mean[t], rs = cpu.rstd[t];
    for (int64_t j = 0; j < h; ++j) {
      const double xh = (tile.x[t * h + j] - mu) * rs;
      wg[j] += times * tile.dy[t * h + j] * xh;
      wb[j] += times * tile.dy[t * h + j];
    }
  }
  const std::vector<float> gdg = dg.floats(), gdb = db.floats();
  for (int64_t j = 0; j < h; ++j) {
    const double scale = std::sqrt(static_cast<double>(R));  // sums of R terms of O(1)
    EXPECT_NEAR(gdg[j], wg[j], rt * (std::abs(wg[j]) + scale)) << "dgamma column " << j;
    EXPECT_NEAR(gdb[j], wb[j], rt * (std::abs(wb[j]) + scale)) << "dbeta column " << j;
  }
  for (void* q : {x, dy, y, dx}) cudaFree(q);
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
