// Several ranks on the visible GPUs (under mpiexec): Stats::kExact LayerNorm / RMSNorm with the
// hidden dim sharded unevenly (a rank may hold no column) over the MPI-staged device
// communicator (any number of ranks on one GPU) and NCCL (a GPU per rank). Each rank's outputs
// must be BITWISE equal to (a) the same op at world size 1 on the GPU over the full rows (this
// rank's columns of y, dx, dgamma, dbeta; all of mean, rstd) and (b) the CPU's kExact on the
// same shards over MPI: the GPU's result does not depend on the world size or the split, and
// is the CPU's. Also: after the strict calls, a disagreeing call and a call that failed on one
// rank are caught by the other ranks' apply kernels from the int64 header (nothing written,
// cuda_check_errors reports). GroupNorm / InstanceNorm with the channels sharded: the same two
// comparisons (GpuExactGroupRanks). Skipped without a GPU.
#include <gtest/gtest.h>

#include <cstring>

#include "exact_support.h"
#include "gpu_checks.h"
#include "group_reference.h"
#include "tpnorm/group_norm.h"
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

NormOptions exact_opt() {
  NormOptions o;
  o.stats = Stats::kExact;
  return o;
}

struct Case {
  const char* name;
  int64_t rows, hidden;
  double offset = 0.0;
  bool zero_on_rank1 = false;
};

std::vector<float> rounded(DType dt, std::vector<float> v) { return Buffer(dt, v).floats(); }

// The row tensors over `cols` columns starting at c0 of the full [rows, hidden] data.
Tensors shard_tensors(const Case& c, DType dt, int64_t c0, int64_t cols) {
  const int64_t R = c.rows, H = c.hidden;
  auto take = [&](const std::vector<float>& m, int64_t rows) {
    return tpnorm_test::columns(m, rows, H, c0, cols);
  };
  Tensors t;
  t.in("x", dt, take(rounded(dt, tpnorm_test::normal(31, 0, R * H, c.offset, 1.5)), R));
  t.in("dy", dt, take(rounded(dt, tpnorm_test::normal(31, 1, R * H)), R));
  t.in("gamma", dt, take(rounded(dt, tpnorm_test::normal(31, 2, H, 1.0, 0.5)), 1));
  t.in("beta", dt, take(rounded(dt, tpnorm_test::normal(31, 3, H)), 1));
  t.out("y", dt, R * cols);
  t.out("dx", dt, R * cols);
  t.out("dgamma", dt, cols);
  t.out("dbeta", dt, cols);
  t.out("mean", DType::F64, R);
  t.out("rstd", DType::F64, R);
  return t;
}

void row_calls(Communicator& comm, const ViewOf& v, bool centered, int64_t R, int64_t h) {
  const Shape s{R, h}, p{h}, r{R};
  const NormOptions o = exact_opt();
  if (centered) {
    layer_norm_forward(comm, v("x", s), v("gamma", p), v("beta", p), v("y", s), v("mean", r),
                       v("rstd", r), o);
    layer_norm_backward(comm, v("dy", s), v("x", s), v("gamma", p), v("mean", r), v("rstd", r),
                        v("dx", s), v("dgamma", p), v("dbeta", p), o);
  } else {
    rms_norm_forward(comm, v("x", s), v("gamma", p), v("y", s), v("rstd", r), o);
    rms_norm_backward(comm, v("dy", s), v("x", s), v("gamma", p), v("rstd", r), v("dx", s),
                      v("dgamma", p), o);
  }
}

// Columns [c0, c0 + cols) of every [rows, H] or [H] output of a full-width run.
std::map<std::string, Buffer> take_columns(std::map<std::string, Buffer> full, int64_t R, int64_t H,
                                           int64_t c0, int64_t cols) {
  for (const char* n : {"y", "dx"}) {
    Buffer& b = full.at(n);
    b = Buffer(b.dtype(), tpnorm_test::columns(b.floats(), R, H, c0, cols));
  }
  for (const char* n : {"dgamma", "dbeta"}) {
    Buffer& b = full.at(n);
    b = Buffer(b.dtype(), tpnorm_test::columns(b.floats(), 1, H, c0, cols));
  }
  return full;
}

using Param = std::tuple<Case, bool, DType, Kind>;
class GpuExactRanks : public ::testing::TestWithParam<Param> {};

TEST_P(GpuExactRanks, BitwiseEqualToOneGpuAndToCpuShards) {
  TPNORM_REQUIRE_GPU();
  const auto [c, centered, dt, kind] = GetParam();
  cudaStream_t s = nullptr;
  std::string skip;
  auto gpu = make_comm(kind, &s, &skip);
  if (!gpu) GTEST_SKIP() << skip;
  const int P = tpnorm_test::world_size(), me = tpnorm_test::world_rank();
  std::vector<int> weights(P, 1);
  if (c.zero_on_rank1 && P > 1) weights[1] = 0;
  if (P > 2) weights[P - 1] = 3;
  const auto sp = tpnorm_test::split_weighted(c.hidden, weights);
  const int64_t c0 = sp.offset[me], h = sp.count[me];
  const Tensors mine = shard_tensors(c, dt, c0, h);
  const int dev = gpu->device().index;
  const auto got = run_tensors(*gpu, mine, dev,
                               [&](const ViewOf& v) { row_calls(*gpu, v, centered, c.rows, h); });
  EXPECT_NO_THROW(cuda_check_errors(*gpu));
  // (a) world size 1 on this GPU, full rows.
  std::map<std::string, Buffer> one;
  {
    cudaStream_t s1 = nullptr;
    cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
    auto single = make_cuda_single_communicator(s1, dev);
    one = run_tensors(*single, shard_tensors(c, dt, 0, c.hidden), dev,
                      [&](const ViewOf& v) { row_calls(*single, v, centered, c.rows, c.hidden); });
    single.reset();
    cudaStreamDestroy(s1);
  }
  std::string first_one, first_cpu;
  const int64_t vs_one =
      count_bit_differences(got, take_columns(one, c.rows, c.hidden, c0, h), &first_one);
  // (b) the CPU kernels on the same shards over MPI.
  auto cpu = make_mpi_communicator(MPI_COMM_WORLD);
  const auto want = run_tensors(*cpu, mine, -1,
                                [&](const ViewOf& v) { row_calls(*cpu, v, centered, c.rows, h); });
  const int64_t vs_cpu = count_bit_differences(got, want, &first_cpu);
  EXPECT_EQ(vs_one, 0) << "rank " << me << " vs one GPU rank, first: " << first_one;
  EXPECT_EQ(vs_cpu, 0) << "rank " << me << " vs CPU, first: " << first_cpu;
  EXPECT_EQ(tpnorm_test::sum_over_ranks(vs_one + vs_cpu), 0) << "differences, all ranks";
  gpu.reset();
  cudaStreamDestroy(s);
}

const Case kCases[] = {
    {"r64_h1000", 64, 1000},
    {"r17_h33_zero_on_rank1", 17, 33, 0.0, true},
    {"r5_h3", 5, 3},  // at 4 ranks one rank has no column
    {"r4_h5000_offset1e4", 4, 5000, 1e4},
    {"r300_h200_offset1e6", 300, 200, 1e6, true},  // two dgamma blocks
};

std::string name(const ::testing::TestParamInfo<Param>& i) {
  return std::string(std::get<1>(i.param) ? "LayerNorm_" : "RMSNorm_") + std::get<0>(i.param).name +
         "_" + dtype_name(std::get<2>(i.param)) +
         (std::get<3>(i.param) == Kind::kNccl ? "_nccl" : "_staged");
}

INSTANTIATE_TEST_SUITE_P(Staged, GpuExactRanks,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Bool(),
                                            ::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Values(Kind::kStaged)),
                         name);
INSTANTIATE_TEST_SUITE_P(Nccl, GpuExactRanks,
                         ::testing::Combine(::testing::Values(kCases[0], kCases[3]),
                                            ::testing::Bool(), ::testing::Values(DType::F32),
                                            ::testing::Values(Kind::kNccl)),
                         name);

// GroupNorm / InstanceNorm with the channels sharded unevenly (groups span ranks; at 3 ranks
// one rank holds none): each rank bitwise equal to the GPU at world size 1 (its channels of y,
// dx, dgamma, dbeta; all of mean, rstd) and to the CPU's kExact on the same shards over MPI.
using GroupParam = std::tuple<int64_t, DType, Kind>;  // groups (0: InstanceNorm), dtype, comm
class GpuExactGroupRanks : public ::testing::TestWithParam<GroupParam> {};

TEST_P(GpuExactGroupRanks, BitwiseEqualToOneGpuAndToCpuShards) {
  TPNORM_REQUIRE_GPU();
  const auto [groups, dt, kind] = GetParam();
  cudaStream_t s = nullptr;
  std::string skip;
  auto gpu = make_comm(kind, &s, &skip);
  if (!gpu) GTEST_SKIP() << skip;
  const int P = tpnorm_test::world_size(), me = tpnorm_test::world_rank();
  const int64_t N = 3, C = 8, S = 77, G = groups ? groups : C;
  std::vector<int> weights(P, 1);
  if (P > 2) weights[1] = 0, weights[P - 1] = 3;
  const auto sp = tpnorm_test::split_weighted(C, weights);
  const int64_t c0 = sp.offset[me], cl = sp.count[me];
  const std::vector<float> x = rounded(dt, tpnorm_test::normal(33, 0, N * C * S, 100.0, 1.5)),
                           dy = rounded(dt, tpnorm_test::normal(33, 1, N * C * S)),
                           gamma = rounded(dt, tpnorm_test::normal(33, 2, C, 1.0, 0.5)),
                           beta = rounded(dt, tpnorm_test::normal(33, 3, C));
  // The tensors of channels [k0, k0 + nc).
  auto tensors = [&](int64_t k0, int64_t nc) {
    Tensors t;
    t.in("x", dt, tpnorm_test::channel_slice(x, N, C, S, k0, nc));
    t.in("dy", dt, tpnorm_test::channel_slice(dy, N, C, S, k0, nc));
    t.in("gamma", dt, std::vector<float>(gamma.begin() + k0, gamma.begin() + k0 + nc));
    t.in("beta", dt, std::vector<float>(beta.begin() + k0, beta.begin() + k0 + nc));
    t.out("y", dt, N * nc * S);
    t.out("dx", dt, N * nc * S);
    t.out("dgamma", dt, nc);
    t.out("dbeta", dt, nc);
    t.out("mean", DType::F32, N * G);
    t.out("rstd", DType::F32, N * G);
    return t;
  };
  auto calls = [&](Communicator& comm, const ViewOf& v, int64_t k0, int64_t nc) {
    ChannelGroups cg;
    cg.groups = groups;
    cg.channels = C;
    cg.channel_offset = k0;
    const Shape sh{N, nc, S}, p{nc}, st{N * G};
    const NormOptions o = exact_opt();
    if (groups == 0) {
      instance_norm_forward(comm, v("x", sh), cg, v("gamma", p), v("beta", p), v("y", sh),
                            v("mean", st), v("rstd", st), o);
      instance_norm_backward(comm, v("dy", sh), v("x", sh), cg, v("gamma", p), v("mean", st),
                             v("rstd", st), v("dx", sh), v("dgamma", p), v("dbeta", p), o);
    } else {
      group_norm_forward(comm, v("x", sh), cg, v("gamma", p), v("beta", p), v("y", sh),
                         v("mean", st), v("rstd", st), o);
      group_norm_backward(comm, v("dy", sh), v("x", sh), cg, v("gamma", p), v("mean", st),
                          v("rstd", st), v("dx", sh), v("dgamma", p), v("dbeta", p), o);
    }
  };
  const Tensors mine = tensors(c0, cl);
  const int dev = gpu->device().index;
  const auto got = run_tensors(*gpu, mine, dev, [&](const ViewOf& v) { calls(*gpu, v, c0, cl); });
  EXPECT_NO_THROW(cuda_check_errors(*gpu));
  std::map<std::string, Buffer> one;
  {
    cudaStream_t s1 = nullptr;
    cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
    auto single = make_cuda_single_communicator(s1, dev);
    one = run_tensors(*single, tensors(0, C), dev,
                      [&](const ViewOf& v) { calls(*single, v, 0, C); });
    single.reset();
    cudaStreamDestroy(s1);
  }
  for (const char* n : {"y", "dx"}) {
    Buffer& b = one.at(n);
    b = Buffer(b.dtype(), tpnorm_test::channel_slice(b.floats(), N, C, S, c0, cl));
  }
  for (const char* n : {"dgamma", "dbeta"}) {
    Buffer& b = one.at(n);
    b = Buffer(b.dtype(), tpnorm_test::columns(b.floats(), 1, C, c0, cl));
  }
  std::string first_one, first_cpu;
  const int64_t vs_one = count_bit_differences(got, one, &first_one);
  auto cpu = make_mpi_communicator(MPI_COMM_WORLD);
  const auto want = run_tensors(*cpu, mine, -1, [&](const ViewOf& v) { calls(*cpu, v, c0, cl); });
  const int64_t vs_cpu = count_bit_differences(got, want, &first_cpu);
  EXPECT_EQ(vs_one, 0) << "rank " << me << " vs one GPU rank, first: " << first_one;
  EXPECT_EQ(vs_cpu, 0) << "rank " << me << " vs CPU, first: " << first_cpu;
  EXPECT_EQ(tpnorm_test::sum_over_ranks(vs_one + vs_cpu), 0) << "differences, all ranks";
  gpu.reset();
  cudaStreamDestroy(s);
}

std::string group_name(const ::testing::TestParamInfo<GroupParam>& i) {
  const int64_t g = std::get<0>(i.param);
  return (g == 0 ? std::string("InstanceNorm") : "GroupNorm_g" + std::to_string(g)) + "_" +
         dtype_name(std::get<1>(i.param)) +
         (std::get<2>(i.param) == Kind::kNccl ? "_nccl" : "_staged");
}

INSTANTIATE_TEST_SUITE_P(Staged, GpuExactGroupRanks,
                         ::testing::Combine(::testing::Values(int64_t{2}, int64_t{1}, int64_t{0}),
                                            ::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Values(Kind::kStaged)),
                         group_name);
INSTANTIATE_TEST_SUITE_P(Nccl, GpuExactGroupRanks,
                         ::testing::Combine(::testing::Values(int64_t{2}),
                                            ::testing::Values(DType::F32),
                                            ::testing::Values(Kind::kNccl)),
                         group_name);

// After the strict calls the summed int64 header is checked on device: a call whose eps differs
// on the last rank, and a call whose gamma is wrong on rank 0, write nothing on any rank, and
// cuda_check_errors reports it (the failing rank throws its own message from the call).
TEST(GpuExactRanksErrors, DeviceHeaderCheckStopsBadCalls) {
  TPNORM_REQUIRE_GPU();
  const int P = tpnorm_test::world_size(), me = tpnorm_test::world_rank();
  if (P < 2) GTEST_SKIP() << "needs 2 ranks";
  cudaStream_t s = nullptr;
  std::string skip;
  auto gpu = make_comm(Kind::kStaged, &s, &skip);
  gpu->set_strict_calls(0);
  const int64_t R = 6, h = 40;
  const Shape sh{R, h}, r{R};
  const int dev = gpu->device().index;
  const std::vector<float> sentinel(R * h, 42.f);
  DevBuf x(Buffer(DType::F32, tpnorm_test::normal(3, me, R * h)), false, dev),
      y(Buffer(DType::F32, sentinel), false, dev), mean(Buffer(DType::F32, R), false, dev),
      rstd(Buffer(DType::F32, R), false, dev),
      gamma(Buffer(DType::F32, std::vector<float>(me == 0 ? h + 1 : h, 1.f)), false, dev);
  int64_t bad = 0;
  // eps differs on the last rank: nobody throws from the call; the device check reports.
  NormOptions opt = exact_opt();
  opt.eps = me == P - 1 ? 1e-3 : 1e-5;
  try {
    layer_norm_forward(*gpu, x.view(sh), {}, {}, y.view(sh), mean.view(r), rstd.view(r), opt);
  } catch (const Error&) {
    ++bad;
  }
  bool reported = false;
  try {
    cuda_check_errors(*gpu);
  } catch (const Error& e) {
    reported = e.code() == ErrorCode::kMismatch;
  }
  bad += !reported;
  for (float v : y.floats()) bad += v != 42.f;
  // gamma of the wrong length on rank 0: rank 0 throws; the others' kernels see its flag.
  bool threw = false;
  try {
    layer_norm_forward(*gpu, x.view(sh), gamma.view(Shape{me == 0 ? h + 1 : h}), {}, y.view(sh),
                       mean.view(r), rstd.view(r), exact_opt());
  } catch (const Error&) {
    threw = true;
  }
  bad += threw != (me == 0);
  if (me != 0) {
    reported = false;
    try {
      cuda_check_errors(*gpu);
    } catch (const Error&) {
      reported = true;
    }
    bad += !reported;
  }
  cudaStreamSynchronize(s);
  for (float v : y.floats()) bad += v != 42.f;
  EXPECT_EQ(tpnorm_test::sum_over_ranks(bad), 0) << "rank " << me;
  gpu.reset();
  cudaStreamDestroy(s);
}

}  // namespace
