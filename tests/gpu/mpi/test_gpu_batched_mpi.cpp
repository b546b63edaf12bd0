// Batched norms on device memory (under mpiexec; the MPI-staged device communicator, or NCCL
// when every rank has a GPU): three items of different kinds, dtypes and widths — LayerNorm
// fp32 13 x 1000, RMSNorm bf16 3 x 1030, LayerNorm fp16 1 x 7 — each hidden-sharded unevenly,
// forward and backward in ONE collective each. Every item's shard must match the float64
// reference on the full data and the CPU op on the same shards, element by element
// (tolerances in gpu_checks.h). Skipped without a GPU.
#include <gtest/gtest.h>

#include "gpu_checks.h"
#include "tpnorm/batched.h"
#include "tpnorm/cuda_mpi.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_gpu;
using tpnorm_test::Buffer;

namespace {

struct ItemCase {
  bool centered;
  DType dt;
  int64_t rows, hidden;
};

struct ItemData {
  ItemCase c;
  RowIn full, in;
  int64_t c0 = 0;
};

ItemData make_item(const ItemCase& c, int k) {
  const int P = tpnorm_test::world_size(), me = tpnorm_test::world_rank();
  std::vector<int> weights(P, 1);
  weights[(k + 1) % P] = P > 1 ? 2 : 1;  // a different uneven split per item
  const auto sp = tpnorm_test::split_weighted(c.hidden, weights);
  auto round = [&](std::vector<float> v) { return Buffer(c.dt, v).floats(); };
  ItemData d;
  d.c = c;
  d.full.rows = c.rows;
  d.full.h = c.hidden;
  d.full.dtype = c.dt;
  d.full.x = round(tpnorm_test::normal(60 + k, 0, c.rows * c.hidden, 2.0, 1.5));
  d.full.dy = round(tpnorm_test::normal(60 + k, 1, c.rows * c.hidden));
  d.full.gamma = round(tpnorm_test::normal(60 + k, 2, c.hidden, 1.0, 0.5));
  d.full.beta = c.centered ? round(tpnorm_test::normal(60 + k, 3, c.hidden)) : std::vector<float>{};
  d.c0 = sp.offset[me];
  const int64_t h = sp.count[me];
  d.in = d.full;
  d.in.h = h;
  d.in.x = tpnorm_test::columns(d.full.x, c.rows, c.hidden, d.c0, h);
  d.in.dy = tpnorm_test::columns(d.full.dy, c.rows, c.hidden, d.c0, h);
  d.in.gamma = tpnorm_test::columns(d.full.gamma, 1, c.hidden, d.c0, h);
  if (c.centered) d.in.beta = tpnorm_test::columns(d.full.beta, 1, c.hidden, d.c0, h);
  return d;
}

class GpuBatched : public ::testing::TestWithParam<bool> {};  // nccl

TEST_P(GpuBatched, ItemsMatchReferenceAndCpuShards) {
  TPNORM_REQUIRE_GPU();
  const bool nccl = GetParam();
  const int P = tpnorm_test::world_size();
#ifndef TPNORM_WITH_NCCL
  if (nccl) GTEST_SKIP() << "built without NCCL";
#endif
  if (nccl && gpu_count() < P) GTEST_SKIP() << "NCCL needs a GPU per rank";
  const int dev = local_cuda_device(MPI_COMM_WORLD);
  cudaSetDevice(dev);
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  std::unique_ptr<Communicator> comm;
#ifdef TPNORM_WITH_NCCL
  if (nccl) comm = make_nccl_communicator(MPI_COMM_WORLD, s);
#endif
  if (!comm) comm = make_mpi_staged_cuda_communicator(MPI_COMM_WORLD, s, dev);
  const ItemCase cases[] = {
      {true, DType::F32, 13, 1000}, {false, DType::BF16, 3, 1030}, {true, DType::F16, 1, 7}};
  constexpr int K = 3;
  std::vector<ItemData> data;
  for (int k = 0; k < K; ++k) data.push_back(make_item(cases[k], k));
  // Device buffers per item: x dy gamma beta y dx dgamma dbeta mean rstd.
  std::vector<std::vector<DevBuf>> b(K);
  std::vector<RowNormItem> fwd(K);
  std::vector<RowNormGradItem> bwd(K);
  for (int k = 0; k < K; ++k) {
    const RowIn& in = data[k].in;
    const DType dt = in.dtype;
    const int64_t R = in.rows, h = in.h;
    b[k].reserve(10);
    for (const auto& v : {in.x, in.dy, in.gamma, in.beta})
      b[k].emplace_back(Buffer(dt, v), false, dev);
    for (int64_t n : {R * h, R * h, h, h}) b[k].emplace_back(Buffer(dt, n), false, dev);
    for (int i = 0; i < 2; ++i) b[k].emplace_back(Buffer(DType::F32, R), false, dev);
    const Shape sx{R, h}, p{h}, r{R};
    const bool c = data[k].c.centered;
    auto& v = b[k];
    fwd[k] = {c,
              v[0].view(sx),
              v[2].view(p),
              c ? v[3].view(p) : TensorView{},
              v[4].view(sx),
              c ? v[8].view(r) : TensorView{},
              v[9].view(r)};
    bwd[k] = {c,
              v[1].view(sx),
              v[0].view(sx),
              v[2].view(p),
              c ? v[8].view(r) : TensorView{},
              v[9].view(r),
              v[5].view(sx),
              v[6].view(p),
              c ? v[7].view(p) : TensorView{}};
  }
  comm->reset_counters();
  batched_norm_forward(*comm, fwd.data(), K);
  batched_norm_backward(*comm, bwd.data(), K);
  cudaStreamSynchronize(s);
  EXPECT_NO_THROW(cuda_check_errors(*comm));
  EXPECT_EQ(comm->counters().calls, 2u) << "one collective per batched forward and backward";
  auto cpu = make_mpi_communicator(MPI_COMM_WORLD);
  int64_t wrong = 0;
  for (int k = 0; k < K; ++k) {
    const ItemData& d = data[k];
    const auto& v = b[k];
    const RowOut got{v[4].floats(), v[8].floats(), v[9].floats(),
                     v[5].floats(), v[6].floats(), v[7].floats()};
    const RowOut want = run_rows(*cpu, d.c.centered, d.in, -1);
    const auto ref = tpnorm_test::row_norm_reference(d.c.centered, d.full.x, d.c.rows, d.c.hidden,
                                                     d.full.gamma, d.full.beta, 1e-5, d.full.dy);
    const int64_t w =
        count_wrong_rows(got, want, ref, d.c.centered, d.c.dt, d.c.rows, d.c.hidden, d.c0, d.in.h);
    EXPECT_EQ(w, 0) << "item " << k;
    wrong += w;
  }
  EXPECT_EQ(tpnorm_test::sum_over_ranks(wrong), 0) << "elements out of tolerance, all ranks";
  b.clear();
  comm.reset();
  cudaStreamDestroy(s);
}

INSTANTIATE_TEST_SUITE_P(Comm, GpuBatched, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return std::string(i.param ? "nccl" : "staged");
                         });

}  // namespace
