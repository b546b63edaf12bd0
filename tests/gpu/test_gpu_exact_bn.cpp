// One GPU, one process: SyncBatchNorm's Stats::kExact on the CUDA kernels
// (kernels/cuda/exact_channels.cu) against the CPU's kExact on the same inputs, BITWISE, every
// output (y, saved and running statistics, dx, dgamma, dbeta; training and eval, and the eval
// backward without parameter gradients), and against the float64 reference on the whole batch
// (tolerances of mpi/test_gpu_batch_norm_mpi.cpp). Shapes: one sample of 7x7, channels not a
// multiple of 8, [N, C] without spatial dims, a channel of 320000 values per rank (40 blocks
// a channel, added as int64), NCHW and channels-last; fp32, bf16, fp16; float64 saved and
// running statistics, offsets 1e4 and 1e6, no affine, cumulative momentum, a channel with an
// inf (its statistics NaN on both). Skipped without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "batch_norm_reference.h"
#include "exact_bn_support.h"
#include "tpnorm/cuda.h"
#include "tpnorm/error.h"

using namespace tpnorm;
using namespace tpnorm_gpu;

namespace {

using Param = std::tuple<BnCase, bool>;  // case, channels-last
class GpuExactBn : public ::testing::TestWithParam<Param> {};

TEST_P(GpuExactBn, BitwiseEqualToCpuAndNearReference) {
  TPNORM_REQUIRE_GPU();
  const auto [cs, cl] = GetParam();
  const BnData d = bn_data(cs, cl);
  const Tensors t = bn_tensors(cs, d, 0, cs.n);
  cudaStream_t s = nullptr;
  TPNORM_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::map<std::string, Buffer> got;
  int64_t tracked_gpu = 0;
  {
    auto gpu = make_cuda_single_communicator(s, 0);
    got = run_tensors(*gpu, t, 0,
                      [&](const ViewOf& v) { tracked_gpu = bn_calls(*gpu, v, cs, cs.n, cl); });
    EXPECT_NO_THROW(cuda_check_errors(*gpu));
  }
  cudaStreamDestroy(s);
  auto cpu = make_single_communicator();
  int64_t tracked_cpu = 0;
  const auto want = run_tensors(
      *cpu, t, -1, [&](const ViewOf& v) { tracked_cpu = bn_calls(*cpu, v, cs, cs.n, cl); });
  std::string first;
  EXPECT_EQ(count_bit_differences(got, want, &first), 0) << "first: " << first;
  EXPECT_EQ(tracked_gpu, 4);
  EXPECT_EQ(tracked_cpu, 4);
  if (cs.bad) {  // channel 0's statistics are NaN (on both: compared above)
    EXPECT_TRUE(std::isnan(got.at("save_mean").floats()[0]));
    return;
  }

  // The float64 reference on the whole batch (NCHW).
  const int64_t N = cs.n, C = cs.c, inner = cs.inner(), count = N * inner;
  auto nchw = [&](const std::vector<float>& v) {
    return cl ? tpnorm_test::from_channels_last(v, N, C, inner) : v;
  };
  auto layout = [&](const std::vector<double>& v) {
    return cl ? tpnorm_test::to_channels_last(v, N, C, inner) : v;
  };
  const std::vector<float> no;
  const auto& h = t.host;
  const std::vector<float> gamma = cs.affine ? h.at("gamma").floats() : no,
                           beta = cs.affine ? h.at("beta").floats() : no;
  const double eps = BatchNormOptions{}.eps;
  const auto ref =
      tpnorm_test::batch_norm_reference(nchw(d.x), N, C, inner, gamma, beta, eps, nchw(d.dy));
  const double m = cs.cumulative ? 1.0 / 4.0 : 0.1;
  std::vector<double> invstd(C), rm(C), rv(C);
  for (int64_t ch = 0; ch < C; ++ch) {
    invstd[ch] = 1.0 / std::sqrt(ref.var[ch] + eps);
    rm[ch] = (1 - m) * 0.25 + m * ref.mean[ch];
    rv[ch] = (1 - m) * 2.0 + m * ref.var[ch] * count / (count - 1);
  }
  const std::vector<float> grm = got.at("running_mean").floats(),
                           grv = got.at("running_var").floats();
  const auto eref = tpnorm_test::batch_norm_eval_reference(
      nchw(d.x), N, C, inner, gamma, beta, {grm.begin(), grm.end()}, {grv.begin(), grv.end()}, eps,
      nchw(d.dy));
  std::vector<double> einv(C);
  for (int64_t ch = 0; ch < C; ++ch) einv[ch] = 1.0 / std::sqrt(grv[ch] + eps);
  const double rt = tpnorm_test::storage_rtol(cs.dt);
  const double is_max = std::max(*std::max_element(invstd.begin(), invstd.end()),
                                 *std::max_element(einv.begin(), einv.end()));
  int64_t wrong = 0;
  auto check = [&](const char* n, const std::vector<double>& w, double atol, double rtol) {
    wrong += tpnorm_test::count_wrong(n, got.at(n).floats(), w, atol, rtol);
  };
  check("y", layout(ref.y), rt, rt);
  check("save_mean", ref.mean, 1e-6, 1e-6);
  check("save_invstd", invstd, 0, 1e-5);
  check("running_mean", rm, 1e-6, 1e-5);
  check("running_var", rv, 1e-6, 1e-5);
  check("dx", layout(ref.dx), rt * std::max(1.0, is_max), 10 * rt);
  check("y_eval", layout(eref.y), rt, rt);
  check("save_invstd_eval", einv, 0, 1e-6);
  check("dx_eval", layout(eref.dx), rt * std::max(1.0, is_max), 10 * rt);
  check("dx_eval_nograd", layout(eref.dx), rt * std::max(1.0, is_max), 10 * rt);
  if (cs.affine) {
    check("dgamma", ref.dgamma, rt * count, rt);
    check("dbeta", ref.dbeta, rt * count, rt);
  }
  EXPECT_EQ(wrong, 0);
}

// After the strict calls (the header then travels on device only) the exact kernels check the
// summed int64 header themselves: a training forward with one value per channel in all (n <= 1)
// writes nothing (y, saved and running statistics keep their sentinels) and
// cuda_check_errors reports it; a call whose gamma has the wrong length throws on this rank
// and writes nothing; a good call afterwards writes.
TEST(GpuExactBnErrors, FailedCallsAfterStrictCallsWriteNothing) {
  TPNORM_REQUIRE_GPU();
  cudaStream_t s = nullptr;
  TPNORM_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  {
    auto gpu = make_cuda_single_communicator(s, 0);
    gpu->set_strict_calls(0);
    const int64_t C = 4;
    const Shape one{1, C}, two{2, C, 3}, p{C};
    BatchNormOptions o;
    o.stats = Stats::kExact;
    DevBuf x(Buffer(DType::F32, tpnorm_test::normal(47, 0, 2 * C * 3))),
        y(Buffer(DType::F32, std::vector<float>(2 * C * 3, 7.f))),
        rm(Buffer(DType::F32, std::vector<float>(C, 7.f))),
        rv(Buffer(DType::F32, std::vector<float>(C, 7.f))),
        sm(Buffer(DType::F32, std::vector<float>(C, 7.f))),
        si(Buffer(DType::F32, std::vector<float>(C, 7.f))),
        gamma(Buffer(DType::F32, std::vector<float>(C + 1, 1.f)));
    auto untouched = [&](const char* when) {
      cudaStreamSynchronize(s);
      for (const DevBuf* b : {&y, &rm, &rv, &sm, &si})
        for (float v : b->floats()) EXPECT_EQ(v, 7.f) << when;
    };
    int64_t tracked = 0;
    EXPECT_NO_THROW(sync_batch_norm_forward(*gpu, x.view(one), {}, {}, rm.view(p), rv.view(p),
                                            &tracked, y.view(one), sm.view(p), si.view(p), o));
    EXPECT_THROW(cuda_check_errors(*gpu), Error) << "one value per channel";
    untouched("n == 1");
    EXPECT_THROW(
        sync_batch_norm_forward(*gpu, x.view(two), gamma.view(Shape{C + 1}), {}, rm.view(p),
                                rv.view(p), &tracked, y.view(two), sm.view(p), si.view(p), o),
        Error);
    untouched("gamma of C + 1");
    sync_batch_norm_forward(*gpu, x.view(two), {}, {}, rm.view(p), rv.view(p), &tracked,
                            y.view(two), sm.view(p), si.view(p), o);
    EXPECT_NO_THROW(cuda_check_errors(*gpu));
    cudaStreamSynchronize(s);
    EXPECT_NE(rm.floats(), std::vector<float>(C, 7.f));
    EXPECT_NE(y.floats()[0], 7.f);
  }
  cudaStreamDestroy(s);
}

using DT = DType;
const BnCase kCases[] = {
    {"n1_c3_7x7", 1, 3, {7, 7}},
    {"n4_c13_5x5_bf16", 4, 13, {5, 5}, DT::BF16},
    {"n6_c6_nospatial_fp16", 6, 6, {}, DT::F16},
    {"n8_c3_200x200_splits_f64stats_offset1e4", 8, 3, {200, 200}, DT::F32, DT::F64, 1e4},
    {"n5_c20_9_f64stats_offset1e6", 5, 20, {9}, DT::F32, DT::F64, 1e6},
    {"n3_c5_11_plain_cumulative_bf16", 3, 5, {11}, DT::BF16, DT::F32, 0.0, false, true},
    {"n2_c70_3x3_fp16", 2, 70, {3, 3}, DT::F16, DT::F32, 3.0},
    {"n3_c4_6_bad", 3, 4, {6}, DT::F32, DT::F32, 0.0, true, false, true},
};

std::string name(const ::testing::TestParamInfo<Param>& i) {
  return std::string(std::get<0>(i.param).name) +
         (std::get<1>(i.param) ? "_channels_last" : "_nchw");
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuExactBn,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Bool()), name);

}  // namespace
