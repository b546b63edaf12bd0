// One GPU, one process: the row-norm backward whose partial kernel also sums dgamma / dbeta's
// columns (each block over its own rows, then the blocks added in order; kernels/cuda/plan.h)
// against the float64 reference at the shapes where that can go wrong: h not a multiple of
// the pack (vector widths 4, 2, 1), h = 1, one row, many more rows than column-sum blocks
// (warp per row and block per row), rows wider than one chunk (column sums per chunk, row sums
// added over chunks), fp32 / fp16 / bf16, LayerNorm and RMSNorm, and a backward without
// parameter gradients (no column sums, the occupancy-sized grid). Skipped without a GPU.
//
// dgamma and dbeta are checked tighter than gpu_checks.h's r * rows: within
// r |want| + 1e-5 sum_r |term| (r = one rounding of the storage type, for the stored result;
// 1e-5 of the terms' absolute sum for float32 sums of at most a few hundred terms per thread
// and the float32 saved mean / rstd), so a row missing from, or counted twice in, a column's
// sum (a term of size ~1 against a bound of ~1e-5 x rows) fails in fp32.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "gpu_checks.h"
#include "tpnorm/cuda.h"

using namespace tpnorm;
using namespace tpnorm_gpu;
using tpnorm_test::Buffer;

namespace {

struct Case {
  const char* name;
  int64_t rows, h;
};

RowIn make_input(const Case& c, DType dt, uint64_t seed) {
  auto round = [&](std::vector<float> v) { return Buffer(dt, v).floats(); };
  RowIn in;
  in.rows = c.rows;
  in.h = c.h;
  in.dtype = dt;
  in.saved = DType::F32;
  in.x = round(tpnorm_test::normal(seed, 0, c.rows * c.h, 0.5, 1.5));
  in.dy = round(tpnorm_test::normal(seed, 1, c.rows * c.h));
  in.gamma = round(tpnorm_test::normal(seed, 2, c.h, 1.0, 0.5));
  in.beta = round(tpnorm_test::normal(seed, 3, c.h));
  return in;
}

// Columns of dgamma (sum dy * xhat) or dbeta (sum dy) outside r |want| + 1e-5 sum |term|.
int64_t wrong_column_sums(const char* what, const std::vector<float>& got, const RowIn& in,
                          const tpnorm_test::RowRef& ref, bool centered, bool dgamma) {
  const double rt = tpnorm_test::storage_rtol(in.dtype);
  int64_t wrong = 0;
  for (int64_t j = 0; j < in.h; ++j) {
    double abs_sum = 0;
    for (int64_t r = 0; r < in.rows; ++r) {
      const double mu = centered ? ref.mean[r] : 0.0;
      const double xh = (in.x[r * in.h + j] - mu) * ref.rstd[r];
      abs_sum += std::abs(in.dy[r * in.h + j] * (dgamma ? xh : 1.0));
    }
    const double want = dgamma ? ref.dgamma[j] : ref.dbeta[j];
    const double tol = rt * std::abs(want) + 1e-5 * abs_sum;
    if (!(std::abs(got[j] - want) <= tol)) {
      if (wrong < 5)
        ADD_FAILURE() << what << "[" << j << "] = " << got[j] << ", want " << want << " +- " << tol;
      ++wrong;
    }
  }
  return wrong;
}

using Param = std::tuple<Case, bool, DType>;  // case, centered, dtype
class GpuRowBackward : public ::testing::TestWithParam<Param> {};

TEST_P(GpuRowBackward, DxDgammaDbetaMatchReference) {
  TPNORM_REQUIRE_GPU();
  const auto [c, centered, dt] = GetParam();
  const RowIn in = make_input(c, dt, 40 + static_cast<uint64_t>(c.rows * 3 + c.h));
  cudaStream_t s = nullptr;
  TPNORM_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  RowOut got;
  {
    auto gpu = make_cuda_single_communicator(s, 0);
    got = run_rows(*gpu, centered, in, 0);
    EXPECT_NO_THROW(cuda_check_errors(*gpu));
  }
  cudaStreamDestroy(s);
  auto cpu_comm = make_single_communicator();
  const RowOut cpu = run_rows(*cpu_comm, centered, in, -1);
  const auto ref =
      tpnorm_test::row_norm_reference(centered, in.x, c.rows, c.h, in.gamma,
                                      centered ? in.beta : std::vector<float>{}, 1e-5, in.dy);
  EXPECT_EQ(count_wrong_rows(got, cpu, ref, centered, dt, c.rows, c.h, 0, c.h), 0);
  EXPECT_EQ(wrong_column_sums("dgamma", got.dgamma, in, ref, centered, true), 0);
  if (centered) {
    EXPECT_EQ(wrong_column_sums("dbeta", got.dbeta, in, ref, centered, false), 0);
  }
}

// Blocks of the column sums (plan.h row_bwd_parts) in brackets.
const Case kCases[] = {
    {"r1_h1", 1, 1},              // one row, one column [1]
    {"r1_h1030", 1, 1030},        // one row, block per row, vector width 2 [1]
    {"r5_h100", 5, 100},          // warp per row, width 4 (fp32) / 4 (16-bit) [1]
    {"r3000_h40", 3000, 40},      // warp per row, 8 rows per block: 3000 rows over [128] blocks
    {"r5000_h229", 5000, 229},    // odd h: scalar loads, [157] blocks of 32 rows
    {"r700_h1025", 700, 1025},    // block per row, scalar, [128] blocks over 700 rows
    {"r2100_h1000", 2100, 1000},  // warp per row, one chunk of 16-byte loads (16-bit) [128]
    {"r37_h8193", 37, 8193},      // block per row, scalar, 5 chunks of 2048 columns [37]
    {"r300_h16400", 300, 16400},  // block per row, 16-byte loads in 16-bit: 3 chunks [128]
};

std::string name(const ::testing::TestParamInfo<Param>& i) {
  return std::string(std::get<1>(i.param) ? "LayerNorm_" : "RMSNorm_") + std::get<0>(i.param).name +
         "_" + dtype_name(std::get<2>(i.param));
}

INSTANTIATE_TEST_SUITE_P(All, GpuRowBackward,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Bool(),
                                            ::testing::Values(DType::F32, DType::F16, DType::BF16)),
                         name);

// Without parameter gradients the partial writes no column sums and runs on the
// occupancy-sized grid (fewer blocks than row groups at 20000 rows: grid-stride); dx must not
// change by a bit from the call that also asks for dgamma / dbeta (same kernels for dx).
TEST(GpuRowBackwardNoParams, DxIsTheSameWithAndWithoutParameterGradients) {
  TPNORM_REQUIRE_GPU();
  for (const Case& c : {Case{"r20000_h64", 20000, 64}, Case{"r600_h2050", 600, 2050}}) {
    const RowIn in = make_input(c, DType::BF16, 7);
    const int64_t R = c.rows, h = c.h;
    const Shape s{R, h}, p{h}, r{R};
    auto gpu = make_cuda_single_communicator(nullptr, 0);
    DevBuf x(Buffer(in.dtype, in.x)), dy(Buffer(in.dtype, in.dy)), g(Buffer(in.dtype, in.gamma)),
        b(Buffer(in.dtype, in.beta)), y(Buffer(in.dtype, R * h)), dx1(Buffer(in.dtype, R * h)),
        dx2(Buffer(in.dtype, R * h)), dg(Buffer(in.dtype, h)), db(Buffer(in.dtype, h)),
        mean(Buffer(DType::F32, R)), rstd(Buffer(DType::F32, R));
    layer_norm_forward(*gpu, x.view(s), g.view(p), b.view(p), y.view(s), mean.view(r),
                       rstd.view(r));
    layer_norm_backward(*gpu, dy.view(s), x.view(s), g.view(p), mean.view(r), rstd.view(r),
                        dx1.view(s), dg.view(p), db.view(p));
    layer_norm_backward(*gpu, dy.view(s), x.view(s), g.view(p), mean.view(r), rstd.view(r),
                        dx2.view(s), {}, {});
    TPNORM_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_NO_THROW(cuda_check_errors(*gpu));
    const std::vector<float> a = dx1.floats(), bb = dx2.floats();
    int64_t differ = 0;
    for (size_t i = 0; i < a.size(); ++i) differ += !(a[i] == bb[i]);
    EXPECT_EQ(differ, 0) << c.name;
    const auto ref =
        tpnorm_test::row_norm_reference(true, in.x, R, h, in.gamma, in.beta, 1e-5, in.dy);
    const double rt = tpnorm_test::storage_rtol(in.dtype);
    const double rs_max = *std::max_element(ref.rstd.begin(), ref.rstd.end());
    EXPECT_EQ(tpnorm_test::count_wrong("dx", bb, ref.dx, rt * std::max(1.0, rs_max), 10 * rt), 0)
        << c.name;
  }
}

// No row: the partials launch no kernel, so the header kernel writes the call header the
// partial would have written (row_norm.cu); the call must succeed, dgamma / dbeta are sums over
// no row (zero) and the apply's check of the header passes (no error flag).
TEST(GpuRowBackwardNoRows, HeaderWithoutPartialKernel) {
  TPNORM_REQUIRE_GPU();
  const int64_t h = 24;
  const Shape s{0, h}, p{h}, r{0};
  auto gpu = make_cuda_single_communicator(nullptr, 0);
  DevBuf x(Buffer(DType::F32, 0)), y(Buffer(DType::F32, 0)), dy(Buffer(DType::F32, 0)),
      dx(Buffer(DType::F32, 0)), mean(Buffer(DType::F32, 0)), rstd(Buffer(DType::F32, 0)),
      g(Buffer(DType::F32, tpnorm_test::normal(3, 0, h))), b(Buffer(DType::F32, h)),
      dg(Buffer(DType::F32, std::vector<float>(h, 7.f))),
      db(Buffer(DType::F32, std::vector<float>(h, 7.f)));
  EXPECT_NO_THROW(layer_norm_forward(*gpu, x.view(s), g.view(p), b.view(p), y.view(s), mean.view(r),
                                     rstd.view(r)));
  EXPECT_NO_THROW(layer_norm_backward(*gpu, dy.view(s), x.view(s), g.view(p), mean.view(r),
                                      rstd.view(r), dx.view(s), dg.view(p), db.view(p)));
  TPNORM_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_NO_THROW(cuda_check_errors(*gpu));
  for (float v : dg.floats()) EXPECT_EQ(v, 0.f);
  for (float v : db.floats()) EXPECT_EQ(v, 0.f);
}

}  // namespace
