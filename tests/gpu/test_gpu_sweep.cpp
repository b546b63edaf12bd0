// The device sweep of gpu-check: LayerNorm and RMSNorm forward + backward on one GPU for
// h in {1, 7, 8, 512, 1000, 1024, 1025, 1536, 2048, 8192} x rows in {1, 5, 4097} x
// fp32 / fp16 / bf16 x aligned / misaligned pointers (one element off: every vector width the
// planner can pick, down to scalar), against the float64 reference and the CPU op on the same
// input, element by element (tolerances in gpu_checks.h). The 5-row cases sit at offset 1e4 +
// N(0, 1.5): their saved mean and rstd must be within 1e-6 (relative) of the CPU op's, which
// only the robust pivot gives (x[0] as the pivot costs up to ~1e-6 on device). Skipped
// without a GPU.
#include <gtest/gtest.h>

#include "gpu_checks.h"
#include "tpnorm/cuda.h"

using namespace tpnorm;
using namespace tpnorm_gpu;
using tpnorm_test::Buffer;

namespace {

using Param = std::tuple<int64_t, int64_t, DType, bool>;  // h, rows, dtype, misaligned
class GpuSweep : public ::testing::TestWithParam<Param> {};

TEST_P(GpuSweep, LayerNormAndRmsNormMatchReferenceAndCpu) {
  TPNORM_REQUIRE_GPU();
  const auto [h, rows, dt, misalign] = GetParam();
  const double offset = rows == 5 ? 1e4 : 0.0;
  auto round = [&](std::vector<float> v) { return Buffer(dt, v).floats(); };
  RowIn in;
  in.rows = rows;
  in.h = h;
  in.dtype = dt;
  in.saved = DType::F32;
  const uint64_t seed = 1000 + static_cast<uint64_t>(h * 7 + rows);
  in.x = round(tpnorm_test::normal(seed, 0, rows * h, offset, 1.5));
  in.dy = round(tpnorm_test::normal(seed, 1, rows * h));
  in.gamma = round(tpnorm_test::normal(seed, 2, h, 1.0, 0.5));
  in.beta = round(tpnorm_test::normal(seed, 3, h));
  cudaStream_t s = nullptr;
  TPNORM_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto gpu = make_cuda_single_communicator(s, 0);
  auto cpu_comm = make_single_communicator();
  for (bool centered : {true, false}) {
    const RowOut got = run_rows(*gpu, centered, in, 0, misalign);
    EXPECT_NO_THROW(cuda_check_errors(*gpu));
    const RowOut cpu = run_rows(*cpu_comm, centered, in, -1);
    const auto ref = tpnorm_test::row_norm_reference(
        centered, in.x, rows, h, in.gamma, centered ? in.beta : std::vector<float>{}, 1e-5, in.dy);
    EXPECT_EQ(count_wrong_rows(got, cpu, ref, centered, dt, rows, h, 0, h), 0)
        << (centered ? "LayerNorm" : "RMSNorm");
  }
  gpu.reset();
  cudaStreamDestroy(s);
}

std::string name(const ::testing::TestParamInfo<Param>& i) {
  return "h" + std::to_string(std::get<0>(i.param)) + "_r" + std::to_string(std::get<1>(i.param)) +
         "_" + dtype_name(std::get<2>(i.param)) +
         (std::get<3>(i.param) ? "_misaligned" : "_aligned") +
         (std::get<1>(i.param) == 5 ? "_offset1e4" : "");
}

INSTANTIATE_TEST_SUITE_P(
    Sweep, GpuSweep,
    ::testing::Combine(::testing::Values(1, 7, 8, 512, 1000, 1024, 1025, 1536, 2048, 8192),
                       ::testing::Values(1, 5, 4097),
                       ::testing::Values(DType::F32, DType::F16, DType::BF16), ::testing::Bool()),
    name);

}  // namespace
