// Fused residual add + norm and GroupNorm / InstanceNorm on device memory (under mpiexec;
// ranks share the visible GPUs through the MPI-staged device communicator, or NCCL when each
// rank has its own GPU), forward and backward, against the float64 references on the full data
// (tests/reference: fused_reference, group_norm_reference) and against the CPU op on the same
// shards over MPI, element by element, with the tolerances of the CPU equivalence tests
// (r = fp32 1e-5, bf16 8e-3): outputs r + r|want|; saved mean / rstd 1e-6 relative to the CPU
// op's (1e-6 + 1e-6 against the reference); input gradients r*max(1, rstd) + 10r|want|;
// parameter gradients (sums over rows) r*rows + r|want|. Uneven splits (a rank may hold no
// column / channel), groups spanning ranks, DeepNorm's alpha, dh_extra on and off, one
// collective per call. Skipped without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "fused_reference.h"
#include "gpu_support.h"
#include "group_reference.h"
#include "harness.h"
#include "tpnorm/cuda_mpi.h"
#include "tpnorm/fused.h"
#include "tpnorm/group_norm.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_test;
using tpnorm_gpu::DevBuf;

namespace {

struct Comm {
  std::unique_ptr<Communicator> comm;
  cudaStream_t stream = nullptr;
  int device = 0;
  ~Comm() {
    comm.reset();
    if (stream) cudaStreamDestroy(stream);
  }
};

// The staged communicator, or NCCL when every rank has a GPU (else *skip says why).
bool make_comm(bool nccl, Comm& c, std::string* skip) {
  const int P = world_size();
#ifndef TPNORM_WITH_NCCL
  if (nccl) return *skip = "built without NCCL", false;
#endif
  if (nccl && tpnorm_gpu::gpu_count() < P) return *skip = "NCCL needs a GPU per rank", false;
  c.device = local_cuda_device(MPI_COMM_WORLD);
  cudaSetDevice(c.device);
  cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking);
#ifdef TPNORM_WITH_NCCL
  if (nccl) c.comm = make_nccl_communicator(MPI_COMM_WORLD, c.stream);
#endif
  if (!c.comm) c.comm = make_mpi_staged_cuda_communicator(MPI_COMM_WORLD, c.stream, c.device);
  return true;
}

std::vector<float> rounded(DType dt, const std::vector<float>& v) { return Buffer(dt, v).floats(); }
std::vector<double> widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// ---- fused ----------------------------------------------------------------------------------

using FusedParam =
    std::tuple<bool, DType, double, bool, bool>;  // centered, dtype, alpha, extra, nccl
class GpuFused : public ::testing::TestWithParam<FusedParam> {};

TEST_P(GpuFused, MatchesReferenceAndCpuShards) {
  TPNORM_REQUIRE_GPU();
  const auto [centered, dt, alpha, extra, nccl] = GetParam();
  Comm c;
  std::string skip;
  if (!make_comm(nccl, c, &skip)) GTEST_SKIP() << skip;
  const int P = world_size(), me = world_rank();
  const int64_t R = 13, H = 1000;
  std::vector<int> weights(P, 2);
  if (P > 2) weights[1] = 0;  // a rank with no column
  const Split sp = split_weighted(H, weights);
  const int64_t c0 = sp.offset[me], h = sp.count[me];
  const auto x = rounded(dt, normal(41, 0, R * H, 3.0, 1.5)), f = rounded(dt, normal(41, 1, R * H));
  const auto gamma = rounded(dt, normal(41, 2, H, 1.0, 0.5)), beta = rounded(dt, normal(41, 3, H));
  const auto dy = rounded(dt, normal(41, 4, R * H)), dhx = rounded(dt, normal(41, 5, R * H));
  std::vector<float> hs(R * H);  // the op's h: alpha*x + f in float32, rounded to dt
  for (size_t i = 0; i < hs.size(); ++i) hs[i] = static_cast<float>(alpha) * x[i] + f[i];
  hs = rounded(dt, hs);
  const FusedRef ref = fused_reference(centered, x, f, alpha, hs, R, H, gamma,
                                       centered ? beta : std::vector<float>{}, 1e-5, dy,
                                       extra ? dhx : std::vector<float>{});
  auto cols = [&](const std::vector<float>& m) { return columns(m, R, H, c0, h); };
  auto dcols = [&](const std::vector<double>& m) {
    std::vector<double> o(static_cast<size_t>(R * h));
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < h; ++j) o[r * h + j] = m[r * H + c0 + j];
    return o;
  };
  auto pcols = [&](const std::vector<double>& v) {
    return std::vector<double>(v.begin() + c0, v.begin() + c0 + h);
  };
  // This rank's shards, on the device.
  const Shape s{R, h}, p{h}, r{R};
  const Device d = Device::cuda(c.device);
  DevBuf gx(Buffer(dt, cols(x)), false, c.device), gf(Buffer(dt, cols(f)), false, c.device),
      gg(Buffer(dt, cols(gamma)), false, c.device), gb(Buffer(dt, cols(beta)), false, c.device),
      gdy(Buffer(dt, cols(dy)), false, c.device), gdh(Buffer(dt, cols(dhx)), false, c.device),
      gh(Buffer(dt, R * h), false, c.device), gy(Buffer(dt, R * h), false, c.device),
      gdx(Buffer(dt, R * h), false, c.device), gdf(Buffer(dt, R * h), false, c.device),
      gdg(Buffer(dt, h), false, c.device), gdb(Buffer(dt, h), false, c.device),
      gm(Buffer(DType::F32, R), false, c.device), grs(Buffer(DType::F32, R), false, c.device);
  (void)d;
  c.comm->reset_counters();
  const TensorView dh_extra = extra ? gdh.view(s) : TensorView{};
  if (centered) {
    fused_add_layer_norm_forward(*c.comm, gx.view(s), gf.view(s), alpha, gg.view(p), gb.view(p),
                                 gh.view(s), gy.view(s), gm.view(r), grs.view(r));
    fused_add_layer_norm_backward(*c.comm, gdy.view(s), dh_extra, gh.view(s), gg.view(p),
                                  gm.view(r), grs.view(r), alpha, gdx.view(s), gdf.view(s),
                                  gdg.view(p), gdb.view(p));
  } else {
    fused_add_rms_norm_forward(*c.comm, gx.view(s), gf.view(s), alpha, gg.view(p), gh.view(s),
                               gy.view(s), grs.view(r));
    fused_add_rms_norm_backward(*c.comm, gdy.view(s), dh_extra, gh.view(s), gg.view(p), grs.view(r),
                                alpha, gdx.view(s), gdf.view(s), gdg.view(p));
  }
  cudaStreamSynchronize(c.stream);
  EXPECT_NO_THROW(cuda_check_errors(*c.comm));
  EXPECT_EQ(c.comm->counters().calls, 2u) << "one collective per forward and backward";
  // The CPU op on the same shards.
  auto cpu = make_mpi_communicator(MPI_COMM_WORLD);
  FusedSetup st;
  st.centered = centered;
  st.dt = dt;
  st.alpha = alpha;
  st.rows = R;
  st.h = h;
  st.affine = true;
  st.backward = true;
  st.extra = extra;
  const FusedOut want =
      run_fused(*cpu, st, cols(x), cols(f), cols(gamma), cols(beta), cols(dy), cols(dhx));
  const double rt = storage_rtol(dt);
  const double rs_max = *std::max_element(ref.norm.rstd.begin(), ref.norm.rstd.end());
  const double dxt = rt * std::max(1.0, rs_max) * std::max(1.0, std::abs(alpha));
  int64_t wrong = 0;
  wrong += count_wrong("h", gh.floats(), dcols(ref.h), rt, rt);
  wrong += count_wrong("y", gy.floats(), dcols(ref.norm.y), rt, rt);
  wrong += count_wrong("rstd", grs.floats(), ref.norm.rstd, 1e-6, 1e-6);
  wrong += count_wrong("rstd vs cpu", grs.floats(), widen(want.rstd), 0, 1e-6);
  wrong += count_wrong("df", gdf.floats(), dcols(ref.df), dxt, 10 * rt);
  wrong += count_wrong("dx", gdx.floats(), dcols(ref.dx), dxt, 10 * rt);
  wrong += count_wrong("dgamma", gdg.floats(), pcols(ref.norm.dgamma), rt * R, rt);
  wrong += count_wrong("y vs cpu", gy.floats(), widen(want.y), rt, rt);
  wrong += count_wrong("dx vs cpu", gdx.floats(), widen(want.dx), dxt, 10 * rt);
  if (centered) {
    wrong += count_wrong("mean", gm.floats(), ref.norm.mean, 1e-6, 1e-6);
    wrong += count_wrong("mean vs cpu", gm.floats(), widen(want.mean), 1e-6, 1e-6);
    wrong += count_wrong("dbeta", gdb.floats(), pcols(ref.norm.dbeta), rt * R, rt);
  }
  EXPECT_EQ(sum_over_ranks(wrong), 0) << "elements out of tolerance, all ranks";
}

std::string fused_name(const ::testing::TestParamInfo<FusedParam>& i) {
  return std::string(std::get<0>(i.param) ? "LayerNorm_" : "RMSNorm_") +
         dtype_name(std::get<1>(i.param)) +
         (std::get<2>(i.param) == 1.0 ? "_alpha1" : "_deepnorm") +
         (std::get<3>(i.param) ? "_dh_extra" : "") + (std::get<4>(i.param) ? "_nccl" : "_staged");
}

INSTANTIATE_TEST_SUITE_P(Staged, GpuFused,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Values(1.0, 1.7), ::testing::Bool(),
                                            ::testing::Values(false)),
                         fused_name);
INSTANTIATE_TEST_SUITE_P(Nccl, GpuFused,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(DType::F32),
                                            ::testing::Values(1.7), ::testing::Values(true),
                                            ::testing::Values(true)),
                         fused_name);

// ---- GroupNorm / InstanceNorm ----------------------------------------------------------------

// groups (0: InstanceNorm), dtype, nccl, spatial size (35: scalar accesses; 64: 16-byte
// vectors; 3136: 16-byte vectors, several splits per channel; 1: the planes walk at inner 1)
using GroupParam = std::tuple<int64_t, DType, bool, int64_t>;
class GpuGroupNorm : public ::testing::TestWithParam<GroupParam> {};

TEST_P(GpuGroupNorm, MatchesReferenceAndCpuSlices) {
  TPNORM_REQUIRE_GPU();
  const auto [groups_in, dt, nccl, S] = GetParam();
  Comm c;
  std::string skip;
  if (!make_comm(nccl, c, &skip)) GTEST_SKIP() << skip;
  const int P = world_size(), me = world_rank();
  const bool instance = groups_in == 0;
  const int64_t N = 3, C = 12, G = instance ? C : groups_in;
  std::vector<int> weights(P, 1);
  if (P > 2) weights[2] = 0;  // a rank with no channel; groups span ranks
  const Split sp = split_weighted(C, weights);
  const int64_t c0 = sp.offset[me], cl = sp.count[me];
  const auto x = rounded(dt, normal(43, 0, N * C * S, 2.0, 1.5));
  const auto gamma = rounded(dt, normal(43, 1, C, 1.0, 0.5)), beta = rounded(dt, normal(43, 2, C));
  const auto dy = rounded(dt, normal(43, 3, N * C * S));
  const GroupRef ref = group_norm_reference(x, N, C, S, G, gamma, beta, 1e-5, dy);
  auto slice = [&](const std::vector<float>& v) { return channel_slice(v, N, C, S, c0, cl); };
  const std::vector<float> xs = slice(x), dys = slice(dy);
  const std::vector<float> gs(gamma.begin() + c0, gamma.begin() + c0 + cl),
      bs(beta.begin() + c0, beta.begin() + c0 + cl);
  ChannelGroups cg;
  cg.groups = G;
  cg.channels = C;
  cg.channel_offset = c0;
  const Shape s{N, cl, S}, pc{cl}, st{N * G};
  DevBuf gx(Buffer(dt, xs), false, c.device), gdy(Buffer(dt, dys), false, c.device),
      gg(Buffer(dt, gs), false, c.device), gb(Buffer(dt, bs), false, c.device),
      gy(Buffer(dt, N * cl * S), false, c.device), gdx(Buffer(dt, N * cl * S), false, c.device),
      gdg(Buffer(dt, cl), false, c.device), gdb(Buffer(dt, cl), false, c.device),
      gm(Buffer(DType::F32, N * G), false, c.device),
      grs(Buffer(DType::F32, N * G), false, c.device);
  c.comm->reset_counters();
  if (instance) {
    ChannelGroups ic = cg;
    ic.groups = 0;
    instance_norm_forward(*c.comm, gx.view(s), ic, gg.view(pc), gb.view(pc), gy.view(s),
                          gm.view(st), grs.view(st));
    instance_norm_backward(*c.comm, gdy.view(s), gx.view(s), ic, gg.view(pc), gm.view(st),
                           grs.view(st), gdx.view(s), gdg.view(pc), gdb.view(pc));
  } else {
    group_norm_forward(*c.comm, gx.view(s), cg, gg.view(pc), gb.view(pc), gy.view(s), gm.view(st),
                       grs.view(st));
    group_norm_backward(*c.comm, gdy.view(s), gx.view(s), cg, gg.view(pc), gm.view(st),
                        grs.view(st), gdx.view(s), gdg.view(pc), gdb.view(pc));
  }
  cudaStreamSynchronize(c.stream);
  EXPECT_NO_THROW(cuda_check_errors(*c.comm));
  EXPECT_EQ(c.comm->counters().calls, 2u) << "one collective per forward and backward";
  auto cpu = make_mpi_communicator(MPI_COMM_WORLD);
  GroupSetup gst;
  gst.dt = dt;
  gst.n = N;
  gst.c_local = cl;
  gst.s = S;
  gst.cg = cg;
  gst.affine = true;
  gst.instance = instance;
  const GroupOut want = run_group(*cpu, gst, xs, gs, bs, dys);
  const double rt = storage_rtol(dt);
  const double rs_max = *std::max_element(ref.rstd.begin(), ref.rstd.end());
  const double count = static_cast<double>(N * (C / G) * S);
  int64_t wrong = 0;
  wrong += count_wrong("y", gy.floats(), channel_slice(ref.y, N, C, S, c0, cl), rt, rt);
  wrong += count_wrong("mean", gm.floats(), ref.mean, 1e-6, 1e-6);
  wrong += count_wrong("rstd", grs.floats(), ref.rstd, 1e-6, 1e-6);
  wrong += count_wrong("dx", gdx.floats(), channel_slice(ref.dx, N, C, S, c0, cl),
                       rt * std::max(1.0, rs_max), 10 * rt);
  const std::vector<double> rdg(ref.dgamma.begin() + c0, ref.dgamma.begin() + c0 + cl),
      rdb(ref.dbeta.begin() + c0, ref.dbeta.begin() + c0 + cl);
  wrong += count_wrong("dgamma", gdg.floats(), rdg, rt * count, rt);
  wrong += count_wrong("dbeta", gdb.floats(), rdb, rt * count, rt);
  wrong += count_wrong("y vs cpu", gy.floats(), widen(want.y), rt, rt);
  wrong += count_wrong("rstd vs cpu", grs.floats(), widen(want.rstd), 0, 1e-6);
  wrong +=
      count_wrong("dx vs cpu", gdx.floats(), widen(want.dx), rt * std::max(1.0, rs_max), 10 * rt);
  EXPECT_EQ(sum_over_ranks(wrong), 0) << "elements out of tolerance, all ranks";
}

std::string group_name(const ::testing::TestParamInfo<GroupParam>& i) {
  const int64_t g = std::get<0>(i.param);
  return (g == 0 ? std::string("InstanceNorm") : "GroupNorm_g" + std::to_string(g)) + "_" +
         dtype_name(std::get<1>(i.param)) + (std::get<2>(i.param) ? "_nccl" : "_staged") + "_s" +
         std::to_string(std::get<3>(i.param));
}

INSTANTIATE_TEST_SUITE_P(Staged, GpuGroupNorm,
                         ::testing::Combine(::testing::Values(int64_t{4}, int64_t{1}, int64_t{0}),
                                            ::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Values(false), ::testing::Values(35)),
                         group_name);
INSTANTIATE_TEST_SUITE_P(Shapes, GpuGroupNorm,
                         ::testing::Combine(::testing::Values(int64_t{4}, int64_t{0}),
                                            ::testing::Values(DType::F32, DType::F16, DType::BF16),
                                            ::testing::Values(false),
                                            ::testing::Values(1, 64, 3136)),
                         group_name);
INSTANTIATE_TEST_SUITE_P(Nccl, GpuGroupNorm,
                         ::testing::Combine(::testing::Values(int64_t{4}),
                                            ::testing::Values(DType::F32), ::testing::Values(true),
                                            ::testing::Values(35)),
                         group_name);

}  // namespace
