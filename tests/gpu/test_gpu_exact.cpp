// One GPU, one process: Stats::kExact on the CUDA kernels (kernels/cuda/exact_rows.cu) through
// the ops, on a single-GPU communicator, against the CPU's kExact on the same inputs, BITWISE,
// every output element (y, mean, rstd, dx, dgamma, dbeta; fused h, df, dx; batched items):
// the GPU forms the CPU's integers and applies the CPU's formulas. Also against the float64
// reference (tolerances of gpu_checks.h). Shapes: a warp per row and a block per row, odd
// widths (scalar path) and shifted buffers, more rows than one dgamma block (256), offsets
// 1e4 / 1e6 (where kRobust loses rstd bits and kExact does not), saved float64 statistics, a
// row with inf/NaN (its statistics NaN on both). Plus: a call that fails after the strict
// calls writes nothing. GroupNorm / InstanceNorm (kernels/cuda/exact_groups.cu):
// GpuExactGroups; SyncBatchNorm: test_gpu_exact_bn.cpp.
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "exact_support.h"
#include "gpu_checks.h"
#include "group_reference.h"
#include "harness.h"
#include "tpnorm/batched.h"
#include "tpnorm/cuda.h"
#include "tpnorm/error.h"
#include "tpnorm/fused.h"
#include "tpnorm/group_norm.h"

using namespace tpnorm;
using namespace tpnorm_gpu;

namespace {

NormOptions exact_opt() {
  NormOptions o;
  o.stats = Stats::kExact;
  return o;
}

struct Case {
  const char* name;
  int64_t rows, hidden;
  double offset = 0.0;
  DType saved = DType::F32;
  bool bad_row = false;  // row 0 holds an inf and a NaN
};

std::vector<float> rounded(DType dt, std::vector<float> v) { return Buffer(dt, v).floats(); }

// The row-norm tensors of a case: x, dy, gamma, beta in; y, mean, rstd, dx, dgamma, dbeta out.
Tensors row_tensors(const Case& c, DType dt, std::vector<float>* x_out = nullptr) {
  const int64_t R = c.rows, h = c.hidden;
  std::vector<float> x = rounded(dt, tpnorm_test::normal(21, 0, R * h, c.offset, 1.5));
  if (c.bad_row && h >= 2) {
    x[0] = std::numeric_limits<float>::infinity();
    x[1] = std::numeric_limits<float>::quiet_NaN();
  }
  if (x_out) *x_out = x;
  Tensors t;
  t.in("x", dt, x);
  t.in("dy", dt, rounded(dt, tpnorm_test::normal(21, 1, R * h)));
  t.in("gamma", dt, rounded(dt, tpnorm_test::normal(21, 2, h, 1.0, 0.5)));
  t.in("beta", dt, rounded(dt, tpnorm_test::normal(21, 3, h)));
  t.out("y", dt, R * h);
  t.out("mean", c.saved, R);
  t.out("rstd", c.saved, R);
  t.out("dx", dt, R * h);
  t.out("dgamma", dt, h);
  t.out("dbeta", dt, h);
  return t;
}

// Forward + backward of LayerNorm (centered) or RMSNorm on comm.
void row_calls(Communicator& comm, const ViewOf& v, bool centered, bool affine, int64_t R,
               int64_t h) {
  const Shape s{R, h}, p{h}, r{R};
  const TensorView g = affine ? v("gamma", p) : TensorView{};
  const NormOptions o = exact_opt();
  if (centered) {
    const TensorView b = affine ? v("beta", p) : TensorView{};
    layer_norm_forward(comm, v("x", s), g, b, v("y", s), v("mean", r), v("rstd", r), o);
    layer_norm_backward(comm, v("dy", s), v("x", s), g, v("mean", r), v("rstd", r), v("dx", s),
                        v("dgamma", p), v("dbeta", p), o);
  } else {
    rms_norm_forward(comm, v("x", s), g, v("y", s), v("rstd", r), o);
    rms_norm_backward(comm, v("dy", s), v("x", s), g, v("rstd", r), v("dx", s), v("dgamma", p), o);
  }
}

// GPU and CPU results of the same calls; EXPECTs every output bitwise equal.
template <class Calls>
std::map<std::string, Buffer> expect_gpu_equals_cpu(const Tensors& t, Calls&& calls,
                                                    bool misalign = false) {
  cudaStream_t s = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  std::map<std::string, Buffer> got;
  {
    auto gpu = make_cuda_single_communicator(s, 0);
    got = run_tensors(
        *gpu, t, 0, [&](const ViewOf& v) { calls(*gpu, v); }, misalign);
    EXPECT_NO_THROW(cuda_check_errors(*gpu));
  }
  cudaStreamDestroy(s);
  auto cpu = make_single_communicator();
  const auto want = run_tensors(*cpu, t, -1, [&](const ViewOf& v) { calls(*cpu, v); });
  std::string first;
  EXPECT_EQ(count_bit_differences(got, want, &first), 0) << "first: " << first;
  return got;
}

using Param = std::tuple<Case, bool, bool, DType, bool>;  // case, centered, affine, dtype, misalign
class GpuExactRows : public ::testing::TestWithParam<Param> {};

TEST_P(GpuExactRows, BitwiseEqualToCpuAndNearReference) {
  TPNORM_REQUIRE_GPU();
  const auto [c, centered, affine, dt, misalign] = GetParam();
  std::vector<float> x;
  const Tensors t = row_tensors(c, dt, &x);
  auto got = expect_gpu_equals_cpu(
      t,
      [&](Communicator& comm, const ViewOf& v) {
        row_calls(comm, v, centered, affine, c.rows, c.hidden);
      },
      misalign);
  if (c.bad_row) return;  // the reference has no NaN rows; the CPU comparison covered them
  const auto& h = t.host;
  auto floats = [&](const char* n) { return got.at(n).floats(); };
  const RowOut out{floats("y"),  floats("mean"),   floats("rstd"),
                   floats("dx"), floats("dgamma"), floats("dbeta")};
  const auto ref = tpnorm_test::row_norm_reference(
      centered, x, c.rows, c.hidden, affine ? h.at("gamma").floats() : std::vector<float>{},
      affine && centered ? h.at("beta").floats() : std::vector<float>{}, 1e-5, h.at("dy").floats());
  EXPECT_EQ(count_wrong_rows(out, out, ref, centered, dt, c.rows, c.hidden, 0, c.hidden), 0);
}

const Case kCases[] = {
    {"r71_h229", 71, 229},    // warp per row, odd h: scalar path
    {"r64_h1024", 64, 1024},  // warp per row, vector path
    {"r3_h4096", 3, 4096},    // block per row, vector path
    {"r7_h1030", 7, 1030},    // block per row, h not a multiple of the pack
    {"r1_h1", 1, 1},
    {"r600_h40", 600, 40},  // three dgamma blocks of 256 rows
    {"r260_h1000_offset1e4", 260, 1000, 1e4, DType::F64},
    {"r8_h3000_offset1e6", 8, 3000, 1e6, DType::F64},
    {"r5_h300_bad_row", 5, 300, 0.0, DType::F32, true},
    {"r4_h2000_bad_row", 4, 2000, 0.0, DType::F64, true},
};

std::string name(const ::testing::TestParamInfo<Param>& i) {
  return std::string(std::get<1>(i.param) ? "LayerNorm_" : "RMSNorm_") + std::get<0>(i.param).name +
         (std::get<2>(i.param) ? "_affine_" : "_plain_") + dtype_name(std::get<3>(i.param)) +
         (std::get<4>(i.param) ? "_scalar" : "_aligned");
}

INSTANTIATE_TEST_SUITE_P(Fp32, GpuExactRows,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Bool(),
                                            ::testing::Bool(), ::testing::Values(DType::F32),
                                            ::testing::Bool()),
                         name);
INSTANTIATE_TEST_SUITE_P(
    Half, GpuExactRows,
    ::testing::Combine(::testing::Values(kCases[0], kCases[2], kCases[3], kCases[5]),
                       ::testing::Bool(), ::testing::Values(true),
                       ::testing::Values(DType::F16, DType::BF16), ::testing::Values(false)),
    name);

// Fused residual + LayerNorm / RMSNorm, forward and backward, with and without dh_extra.
TEST(GpuExactFused, BitwiseEqualToCpu) {
  TPNORM_REQUIRE_GPU();
  for (bool centered : {true, false})
    for (bool extra : {true, false})
      for (int64_t hdim : {int64_t{384}, int64_t{1537}}) {
        SCOPED_TRACE(std::string(centered ? "LayerNorm" : "RMSNorm") +
                     " h=" + std::to_string(hdim) + (extra ? " dh_extra" : ""));
        const int64_t R = 33;
        const DType dt = DType::F32;
        Tensors t;
        t.in("x", dt, tpnorm_test::normal(23, 0, R * hdim, 3.0, 1.0));
        t.in("f", dt, tpnorm_test::normal(23, 1, R * hdim));
        t.in("dy", dt, tpnorm_test::normal(23, 2, R * hdim));
        t.in("dh_extra", dt, tpnorm_test::normal(23, 3, R * hdim));
        t.in("gamma", dt, tpnorm_test::normal(23, 4, hdim, 1.0, 0.5));
        t.in("beta", dt, tpnorm_test::normal(23, 5, hdim));
        for (const char* o : {"h", "y", "dx", "df"}) t.out(o, dt, R * hdim);
        t.out("mean", DType::F32, R);
        t.out("rstd", DType::F32, R);
        t.out("dgamma", dt, hdim);
        t.out("dbeta", dt, hdim);
        const double alpha = 0.75;
        expect_gpu_equals_cpu(t, [&](Communicator& comm, const ViewOf& v) {
          const Shape s{R, hdim}, p{hdim}, r{R};
          const NormOptions o = exact_opt();
          const TensorView dhx = extra ? v("dh_extra", s) : TensorView{};
          if (centered) {
            fused_add_layer_norm_forward(comm, v("x", s), v("f", s), alpha, v("gamma", p),
                                         v("beta", p), v("h", s), v("y", s), v("mean", r),
                                         v("rstd", r), o);
            fused_add_layer_norm_backward(comm, v("dy", s), dhx, v("h", s), v("gamma", p),
                                          v("mean", r), v("rstd", r), alpha, v("dx", s), v("df", s),
                                          v("dgamma", p), v("dbeta", p), o);
          } else {
            fused_add_rms_norm_forward(comm, v("x", s), v("f", s), alpha, v("gamma", p), v("h", s),
                                       v("y", s), v("rstd", r), o);
            fused_add_rms_norm_backward(comm, v("dy", s), dhx, v("h", s), v("gamma", p),
                                        v("rstd", r), alpha, v("dx", s), v("df", s), v("dgamma", p),
                                        o);
          }
        });
      }
}

// Two items (a LayerNorm and an RMSNorm of other widths) in one batched call each way.
TEST(GpuExactBatched, BitwiseEqualToCpu) {
  TPNORM_REQUIRE_GPU();
  const int64_t R0 = 300, h0 = 520, R1 = 9, h1 = 2050;
  const DType dt = DType::BF16;
  Tensors t;
  for (int i = 0; i < 2; ++i) {
    const std::string k = std::to_string(i);
    const int64_t R = i ? R1 : R0, h = i ? h1 : h0;
    t.in("x" + k, dt, rounded(dt, tpnorm_test::normal(25, 10 * i, R * h, 2.0, 1.0)));
    t.in("dy" + k, dt, rounded(dt, tpnorm_test::normal(25, 10 * i + 1, R * h)));
    t.in("gamma" + k, dt, rounded(dt, tpnorm_test::normal(25, 10 * i + 2, h, 1.0, 0.5)));
    t.in("beta" + k, dt, rounded(dt, tpnorm_test::normal(25, 10 * i + 3, h)));
    t.out("y" + k, dt, R * h);
    t.out("dx" + k, dt, R * h);
    t.out("mean" + k, DType::F32, R);
    t.out("rstd" + k, DType::F32, R);
    t.out("dgamma" + k, dt, h);
    t.out("dbeta" + k, dt, h);
  }
  expect_gpu_equals_cpu(t, [&](Communicator& comm, const ViewOf& v) {
    RowNormItem fwd[2];
    RowNormGradItem bwd[2];
    for (int i = 0; i < 2; ++i) {
      const std::string k = std::to_string(i);
      const int64_t R = i ? R1 : R0, h = i ? h1 : h0;
      const Shape s{R, h}, p{h}, r{R};
      const bool centered = i == 0;
      fwd[i] = {centered,          v("x" + k, s),
                v("gamma" + k, p), centered ? v("beta" + k, p) : TensorView{},
                v("y" + k, s),     centered ? v("mean" + k, r) : TensorView{},
                v("rstd" + k, r)};
      bwd[i] = {centered,
                v("dy" + k, s),
                v("x" + k, s),
                v("gamma" + k, p),
                centered ? v("mean" + k, r) : TensorView{},
                v("rstd" + k, r),
                v("dx" + k, s),
                v("dgamma" + k, p),
                centered ? v("dbeta" + k, p) : TensorView{}};
    }
    batched_norm_forward(comm, fwd, 2, exact_opt());
    batched_norm_backward(comm, bwd, 2, exact_opt());
  });
}

// After the strict calls (the header then travels on device only): a call that fails on this
// rank (gamma of the wrong length) throws and writes nothing, and the next call works. (The
// other ranks' side, apply kernels that read the failure from the int64 header, is in
// mpi/test_gpu_exact_mpi.cpp.)
TEST(GpuExactErrors, FailedCallAfterStrictCallsWritesNothing) {
  TPNORM_REQUIRE_GPU();
  const int64_t R = 6, h = 100;
  cudaStream_t s = nullptr;
  TPNORM_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  {
    auto gpu = make_cuda_single_communicator(s, 0);
    gpu->set_strict_calls(0);
    const std::vector<float> sentinel(R * h, 7.0f);
    DevBuf x(Buffer(DType::F32, tpnorm_test::normal(27, 0, R * h))),
        y(Buffer(DType::F32, sentinel)), gamma(Buffer(DType::F32, std::vector<float>(h + 1, 1))),
        rstd(Buffer(DType::F32, std::vector<float>(R, 7.0f)));
    EXPECT_THROW(rms_norm_forward(*gpu, x.view(Shape{R, h}), gamma.view(Shape{h + 1}),
                                  y.view(Shape{R, h}), rstd.view(Shape{R}), exact_opt()),
                 Error);
    cudaStreamSynchronize(s);
    EXPECT_EQ(y.floats(), sentinel);
    EXPECT_EQ(rstd.floats(), std::vector<float>(R, 7.0f));
    // The same buffers in a good call afterwards are written.
    rms_norm_forward(*gpu, x.view(Shape{R, h}), TensorView{}, y.view(Shape{R, h}),
                     rstd.view(Shape{R}), exact_opt());
    cudaStreamSynchronize(s);
    EXPECT_NE(y.floats(), sentinel);
  }
  cudaStreamDestroy(s);
}

// GroupNorm / InstanceNorm (kernels/cuda/exact_groups.cu), forward and backward: bitwise the
// CPU's kExact, and near the float64 reference. Odd spatial sizes, groups of one channel
// (InstanceNorm), of all channels, saved float64 statistics, an offset of 1e4, half types, no
// affine, a slot with inf/NaN (its statistics NaN on both; no reference then).
struct GroupCase {
  const char* name;
  int64_t groups;  // 0: InstanceNorm
  int64_t s;
  DType dt = DType::F32, saved = DType::F32;
  bool affine = true;
  double offset = 0.0;
  bool bad = false;
};

TEST(GpuExactGroups, BitwiseEqualToCpuAndNearReference) {
  TPNORM_REQUIRE_GPU();
  const GroupCase cases[] = {
      {"g3_s37", 3, 37},
      {"g2_s1000_f64saved_offset1e4", 2, 1000, DType::F32, DType::F64, true, 1e4},
      {"g1_s129_bf16_plain", 1, 129, DType::BF16, DType::F32, false},
      {"instance_s5_bad", 0, 5, DType::F32, DType::F32, true, 0.0, true},
      {"g3_s300_fp16", 3, 300, DType::F16},
      {"instance_s2049", 0, 2049},
  };
  for (const GroupCase& c : cases) {
    SCOPED_TRACE(c.name);
    const int64_t N = 3, C = 6, S = c.s, G = c.groups ? c.groups : C;
    const DType dt = c.dt;
    std::vector<float> x = rounded(dt, tpnorm_test::normal(31, 0, N * C * S, c.offset, 1.5));
    if (c.bad) {
      x[0] = std::numeric_limits<float>::infinity();
      x[S + 1] = std::numeric_limits<float>::quiet_NaN();
    }
    Tensors t;
    t.in("x", dt, x);
    t.in("dy", dt, rounded(dt, tpnorm_test::normal(31, 1, N * C * S)));
    t.in("gamma", dt, rounded(dt, tpnorm_test::normal(31, 2, C, 1.0, 0.5)));
    t.in("beta", dt, rounded(dt, tpnorm_test::normal(31, 3, C)));
    t.out("y", dt, N * C * S);
    t.out("dx", dt, N * C * S);
    t.out("mean", c.saved, N * G);
    t.out("rstd", c.saved, N * G);
    t.out("dgamma", dt, C);
    t.out("dbeta", dt, C);
    ChannelGroups cg;
    cg.groups = c.groups;
    cg.channels = C;
    auto got = expect_gpu_equals_cpu(t, [&](Communicator& comm, const ViewOf& v) {
      const Shape s{N, C, S}, p{C}, st{N * G};
      const TensorView g = c.affine ? v("gamma", p) : TensorView{};
      const TensorView b = c.affine ? v("beta", p) : TensorView{};
      const NormOptions o = exact_opt();
      if (c.groups == 0) {
        instance_norm_forward(comm, v("x", s), cg, g, b, v("y", s), v("mean", st), v("rstd", st), o);
        instance_norm_backward(comm, v("dy", s), v("x", s), cg, g, v("mean", st), v("rstd", st),
                               v("dx", s), v("dgamma", p), v("dbeta", p), o);
      } else {
        group_norm_forward(comm, v("x", s), cg, g, b, v("y", s), v("mean", st), v("rstd", st), o);
        group_norm_backward(comm, v("dy", s), v("x", s), cg, g, v("mean", st), v("rstd", st),
                            v("dx", s), v("dgamma", p), v("dbeta", p), o);
      }
    });
    if (c.bad) {  // the bad slots' statistics are NaN (on both: compared above)
      EXPECT_TRUE(std::isnan(got.at("rstd").floats()[0]));
      continue;
    }
    const auto& h = t.host;
    const std::vector<float> no;
    const auto ref = tpnorm_test::group_norm_reference(
        x, N, C, S, G, c.affine ? h.at("gamma").floats() : no,
        c.affine ? h.at("beta").floats() : no, 1e-5, h.at("dy").floats());
    const double rt = tpnorm_test::storage_rtol(dt);
    const double rs_max = *std::max_element(ref.rstd.begin(), ref.rstd.end());
    const double count = static_cast<double>(N * (C / G) * S);
    int64_t wrong = 0;
    auto check = [&](const char* n, const std::vector<double>& want, double atol, double rtol) {
      wrong += tpnorm_test::count_wrong(n, got.at(n).floats(), want, atol, rtol);
    };
    check("y", ref.y, rt, rt);
    check("mean", ref.mean, 1e-6, 1e-6);
    check("rstd", ref.rstd, 1e-6, 1e-6);
    check("dx", ref.dx, rt * std::max(1.0, rs_max), 10 * rt);
    if (c.affine) {
      check("dgamma", ref.dgamma, rt * count, rt);
      check("dbeta", ref.dbeta, rt * count, rt);
    }
    EXPECT_EQ(wrong, 0);
  }
}

}  // namespace
