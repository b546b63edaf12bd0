// Several ranks on the visible GPUs (under mpiexec): SyncBatchNorm's Stats::kExact with the
// batch split unevenly over the ranks (at 2 ranks and more rank 1 has no sample, at 3 the last
// has three shares), over the MPI-staged device communicator (any number of ranks on one GPU)
// and NCCL (a GPU per rank). Each rank's outputs must be BITWISE equal to (a) the same calls
// at world size 1 on the GPU over the whole batch (this rank's samples of y and dx; all of the
// saved and running statistics; not dgamma / dbeta, which are each rank's own sums by the API)
// and (b) the CPU's kExact on the same shards over MPI (every output, dgamma / dbeta too): the
// GPU's result does not depend on the world size or the split, and is the CPU's. Training and
// eval, NCHW and channels-last, fp32 / bf16, a channel split over many blocks. Also: after the
// strict calls, bad calls are stopped by the device check of the int64 header
// (GpuExactBnRanksErrors). Skipped without a GPU.
#include <gtest/gtest.h>

#include "exact_bn_support.h"
#include "tpnorm/cuda.h"
#include "tpnorm/cuda_mpi.h"
#include "tpnorm/error.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_gpu;

namespace {

enum class Kind { kStaged, kNccl };

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

using Param = std::tuple<BnCase, bool, Kind>;  // case, channels-last, communicator
class GpuExactBnRanks : public ::testing::TestWithParam<Param> {};

TEST_P(GpuExactBnRanks, BitwiseEqualToOneGpuAndToCpuShards) {
  TPNORM_REQUIRE_GPU();
  const auto [cs, cl, kind] = GetParam();
  cudaStream_t s = nullptr;
  std::string skip;
  auto gpu = make_comm(kind, &s, &skip);
  if (!gpu) GTEST_SKIP() << skip;
  const int P = tpnorm_test::world_size(), me = tpnorm_test::world_rank();
  std::vector<int> weights(P, 1);
  if (P > 1) weights[1] = 0;
  if (P > 2) weights[P - 1] = 3;
  const auto sp = tpnorm_test::split_weighted(cs.n, weights);
  const int64_t b0 = sp.offset[me], nb = sp.count[me], per = cs.c * cs.inner();
  const BnData d = bn_data(cs, cl);
  const Tensors mine = bn_tensors(cs, d, b0, nb);
  const int dev = gpu->device().index;
  const auto got =
      run_tensors(*gpu, mine, dev, [&](const ViewOf& v) { bn_calls(*gpu, v, cs, nb, cl); });
  EXPECT_NO_THROW(cuda_check_errors(*gpu));
  // (a) world size 1 on this GPU, the whole batch: this rank's samples of the element outputs.
  std::map<std::string, Buffer> one;
  {
    cudaStream_t s1 = nullptr;
    cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
    auto single = make_cuda_single_communicator(s1, dev);
    one = run_tensors(*single, bn_tensors(cs, d, 0, cs.n), dev,
                      [&](const ViewOf& v) { bn_calls(*single, v, cs, cs.n, cl); });
    single.reset();
    cudaStreamDestroy(s1);
  }
  for (const char* n : {"y", "dx", "y_eval", "dx_eval", "dx_eval_nograd"}) {
    const std::vector<float> all = one.at(n).floats();
    one.at(n) = Buffer(one.at(n).dtype(),
                       std::vector<float>(all.begin() + b0 * per, all.begin() + (b0 + nb) * per));
  }
  auto without_param_grads = [](std::map<std::string, Buffer> m) {
    for (const char* n : {"dgamma", "dbeta", "dgamma_eval", "dbeta_eval"}) m.erase(n);
    return m;
  };
  std::string first_one, first_cpu;
  const int64_t vs_one =
      count_bit_differences(without_param_grads(got), without_param_grads(one), &first_one);
  // (b) the CPU kernels on the same shards over MPI.
  auto cpu = make_mpi_communicator(MPI_COMM_WORLD);
  const auto want =
      run_tensors(*cpu, mine, -1, [&](const ViewOf& v) { bn_calls(*cpu, v, cs, nb, cl); });
  const int64_t vs_cpu = count_bit_differences(got, want, &first_cpu);
  EXPECT_EQ(vs_one, 0) << "rank " << me << " vs one GPU rank, first: " << first_one;
  EXPECT_EQ(vs_cpu, 0) << "rank " << me << " vs CPU, first: " << first_cpu;
  EXPECT_EQ(tpnorm_test::sum_over_ranks(vs_one + vs_cpu), 0) << "differences, all ranks";
  gpu.reset();
  cudaStreamDestroy(s);
}

using DT = DType;
const BnCase kCases[] = {
    {"n5_c13_7x7", 5, 13, {7, 7}},
    {"n6_c6_nospatial_bf16", 6, 6, {}, DT::BF16},
    {"n7_c2_150x150_splits_offset1e4", 7, 2, {150, 150}, DT::F32, DT::F64, 1e4},
    {"n4_c5_11_bf16_cumulative", 4, 5, {11}, DT::BF16, DT::F32, 0.0, true, true},
};

std::string name(const ::testing::TestParamInfo<Param>& i) {
  return std::string(std::get<0>(i.param).name) +
         (std::get<1>(i.param) ? "_channels_last" : "_nchw") +
         (std::get<2>(i.param) == Kind::kNccl ? "_nccl" : "_staged");
}

INSTANTIATE_TEST_SUITE_P(Staged, GpuExactBnRanks,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Bool(),
                                            ::testing::Values(Kind::kStaged)),
                         name);
INSTANTIATE_TEST_SUITE_P(Nccl, GpuExactBnRanks,
                         ::testing::Combine(::testing::Values(kCases[0], kCases[2]),
                                            ::testing::Bool(), ::testing::Values(Kind::kNccl)),
                         name);

// After the strict calls the summed int64 header is checked on device: a call whose gamma is
// wrong on rank 0 (rank 0 throws) and a call whose eps differs on the last rank write nothing
// on any rank (y, saved and running statistics keep their sentinels); cuda_check_errors
// reports it on the ranks that did not throw.
TEST(GpuExactBnRanksErrors, DeviceHeaderCheckStopsBadCalls) {
  TPNORM_REQUIRE_GPU();
  const int P = tpnorm_test::world_size(), me = tpnorm_test::world_rank();
  if (P < 2) GTEST_SKIP() << "needs 2 ranks";
  cudaStream_t s = nullptr;
  std::string skip;
  auto gpu = make_comm(Kind::kStaged, &s, &skip);
  gpu->set_strict_calls(0);
  const int64_t C = 5;
  const Shape xs{3, C, 4}, p{C};
  const int dev = gpu->device().index;
  const std::vector<float> sentinel(3 * C * 4, 42.f), stat(C, 42.f);
  DevBuf x(Buffer(DType::F32, tpnorm_test::normal(49, me, 3 * C * 4)), false, dev),
      y(Buffer(DType::F32, sentinel), false, dev), rm(Buffer(DType::F32, stat), false, dev),
      rv(Buffer(DType::F32, stat), false, dev), sm(Buffer(DType::F32, stat), false, dev),
      si(Buffer(DType::F32, stat), false, dev),
      gamma(Buffer(DType::F32, std::vector<float>(me == 0 ? C + 1 : C, 1.f)), false, dev);
  int64_t bad = 0, tracked = 0;
  BatchNormOptions o;
  o.stats = Stats::kExact;
  auto reported = [&] {
    try {
      cuda_check_errors(*gpu);
    } catch (const Error&) {
      return true;
    }
    return false;
  };
  bool threw = false;
  try {
    sync_batch_norm_forward(*gpu, x.view(xs), gamma.view(Shape{me == 0 ? C + 1 : C}), {},
                            rm.view(p), rv.view(p), &tracked, y.view(xs), sm.view(p), si.view(p),
                            o);
  } catch (const Error&) {
    threw = true;
  }
  bad += threw != (me == 0);
  if (me != 0) bad += !reported();
  BatchNormOptions odd = o;
  odd.eps = me == P - 1 ? 1e-3 : 1e-5;
  try {
    sync_batch_norm_forward(*gpu, x.view(xs), {}, {}, rm.view(p), rv.view(p), &tracked, y.view(xs),
                            sm.view(p), si.view(p), odd);
  } catch (const Error&) {
    ++bad;  // nobody throws from the call: the device check reports
  }
  bad += !reported();
  cudaStreamSynchronize(s);
  for (const DevBuf* b : {&y, &rm, &rv, &sm, &si})
    for (float v : b->floats()) bad += v != 42.f;
  EXPECT_EQ(tpnorm_test::sum_over_ranks(bad), 0) << "rank " << me;
  gpu.reset();
  cudaStreamDestroy(s);
}

}  // namespace
