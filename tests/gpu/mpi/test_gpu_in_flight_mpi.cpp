// Device calls in flight together, and device calls that are rejected, under mpiexec on the
// visible GPUs (MPI-staged communicator; NCCL where each rank has a GPU of its own):
// - two RMSNorm forwards started before either finishes, finished in reverse order (also with
//   forced row chunks, and with an eval-mode SyncBatchNorm between a start and its finish):
//   each call's y and rstd match its own float64 reference (y: r + r|want|, r = fp32 1e-5;
//   rstd 1e-6 rel), i.e. no call reads another call's statistics from the device workspace;
// - a fused residual + RMSNorm backward rejected on device (one rank's bad argument, past the
//   strict calls) leaves df and dx bit-identical on every accepting rank;
// - a SyncBatchNorm training forward advances num_batches_tracked (and the cumulative
//   momentum) only when it is accepted, and capturing one is refused with tpnorm::Error;
// - a Stats::kNaive SyncBatchNorm training call of 2^24 values per channel is refused on the
//   host, the same error on every rank, before the counter, y or the running statistics move;
// - a call whose workspace must grow while its stream is captured throws tpnorm::Error on a
//   single-GPU communicator (the process goes on).
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "batch_norm_reference.h"
#include "gpu_checks.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/cuda.h"
#include "tpnorm/cuda_mpi.h"
#include "tpnorm/error.h"
#include "tpnorm/fused.h"
#include "tpnorm/split.h"

using namespace tpnorm;
using namespace tpnorm_gpu;
using tpnorm_test::Buffer;

namespace {

enum class Kind { kStaged, kNccl };

// A device copy on the current device (the rank's, set by make_comm), its views naming it.
int current_device() {
  int d = 0;
  cudaGetDevice(&d);
  return d;
}
struct DBuf : DevBuf {
  DBuf() = default;
  explicit DBuf(const Buffer& host) : DevBuf(host, false, current_device()) {}
};

struct ChunkEnv {
  explicit ChunkEnv(const char* v) { setenv("TPNORM_CHUNK", v, 1); }
  ~ChunkEnv() { unsetenv("TPNORM_CHUNK"); }
};

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

// One RMSNorm forward's data: this rank's columns of a [rows, hidden] input whose statistics
// differ from every other call's (offset, scale), its device buffers and its reference.
struct RmsCall {
  int64_t rows, hidden, c0, h;
  std::vector<float> full_x, full_gamma;
  DBuf x, gamma, y, rstd;
  RmsCall(int64_t rows_, int64_t hidden_, uint64_t seed, double offset, double scale)
      : rows(rows_), hidden(hidden_) {
    const int P = tpnorm_test::world_size(), me = tpnorm_test::world_rank();
    const auto sp = tpnorm_test::split_even(hidden, P);
    c0 = sp.offset[me];
    h = sp.count[me];
    full_x = tpnorm_test::normal(seed, 0, rows * hidden, offset, scale);
    full_gamma = tpnorm_test::normal(seed, 1, hidden, 1.0, 0.5);
    x = DBuf(Buffer(DType::F32, tpnorm_test::columns(full_x, rows, hidden, c0, h)));
    gamma = DBuf(Buffer(DType::F32, tpnorm_test::columns(full_gamma, 1, hidden, c0, h)));
    y = DBuf(Buffer(DType::F32, std::vector<float>(rows * h, 0.f)));
    rstd = DBuf(Buffer(DType::F32, std::vector<float>(rows, 0.f)));
  }
  PendingCall start(Communicator& comm) {
    return rms_norm_forward_start(comm, x.view({rows, h}), gamma.view({h}), y.view({rows, h}),
                                  rstd.view({rows}));
  }
  // Elements out of tolerance on this rank.
  int64_t wrong() const {
    const auto ref =
        tpnorm_test::row_norm_reference(false, full_x, rows, hidden, full_gamma, {}, 1e-5);
    const double rt = tpnorm_test::storage_rtol(DType::F32);
    return tpnorm_test::count_wrong("y", y.floats(), ref_cols(ref.y, rows, hidden, c0, h), rt,
                                    rt) +
           tpnorm_test::count_wrong("rstd", rstd.floats(), ref.rstd, 0, 1e-6);
  }
};

class GpuInFlight : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    TPNORM_REQUIRE_GPU();
    std::string skip;
    comm_ = make_comm(GetParam(), &s_, &skip);
    if (!comm_) GTEST_SKIP() << skip;
  }
  void TearDown() override {
    comm_.reset();
    if (s_) cudaStreamDestroy(s_);
  }
  cudaStream_t s_ = nullptr;
  std::unique_ptr<Communicator> comm_;
};

// q's apply must read q's statistics, not k's (the split-phase example of tpnorm/split.h).
TEST_P(GpuInFlight, TwoCallsFinishedInReverseOrderEachMatchItsReference) {
  RmsCall q(48, 1000, 31, 3.0, 0.5), k(48, 1000, 32, -1.0, 4.0);
  for (int step = 0; step < 2; ++step) {  // the second step reuses the pool's regions
    PendingCall pq = q.start(*comm_);
    PendingCall pk = k.start(*comm_);
    pk.finish();
    pq.finish();
    cudaStreamSynchronize(s_);
    EXPECT_NO_THROW(cuda_check_errors(*comm_));
    EXPECT_EQ(tpnorm_test::sum_over_ranks(q.wrong() + k.wrong()), 0)
        << "elements out of tolerance, all ranks, step " << step;
  }
}

TEST_P(GpuInFlight, TwoChunkedCallsFinishedInReverseOrderEachMatchItsReference) {
  ChunkEnv e("8");
  RmsCall q(40, 700, 33, 2.0, 0.25), k(40, 700, 34, -5.0, 3.0);
  PendingCall pq = q.start(*comm_);
  PendingCall pk = k.start(*comm_);
  pk.finish();
  pq.finish();
  cudaStreamSynchronize(s_);
  EXPECT_NO_THROW(cuda_check_errors(*comm_));
  EXPECT_EQ(tpnorm_test::sum_over_ranks(q.wrong() + k.wrong()), 0);
}

// An eval-mode SyncBatchNorm (no collective, device scratch) between q's start and finish.
TEST_P(GpuInFlight, EvalBatchNormBetweenStartAndFinish) {
  RmsCall q(32, 900, 35, 1.5, 2.0);
  const int64_t n = 3, c = 5, inner = 4000;  // scratch larger than q's header + payload
  const auto xb = tpnorm_test::normal(36, 0, n * c * inner, 0.5, 2.0);
  const auto gb = tpnorm_test::normal(36, 1, c, 1.0, 0.3), bb = tpnorm_test::normal(36, 2, c);
  std::vector<float> rm(c), rv(c);
  for (int64_t i = 0; i < c; ++i) rm[i] = 0.1f * i, rv[i] = 1.0f + 0.5f * i;
  DBuf x(Buffer(DType::F32, xb)), g(Buffer(DType::F32, gb)), b(Buffer(DType::F32, bb));
  DBuf dm(Buffer(DType::F32, rm)), dv(Buffer(DType::F32, rv));
  DBuf y(Buffer(DType::F32, std::vector<float>(n * c * inner, 0.f)));
  const Shape sx{n, c, inner}, sc{c};
  BatchNormOptions opt;
  opt.training = false;
  PendingCall pq = q.start(*comm_);
  sync_batch_norm_forward(*comm_, x.view(sx), g.view(sc), b.view(sc), dm.view(sc), dv.view(sc),
                          nullptr, y.view(sx), {}, {}, opt);
  pq.finish();
  cudaStreamSynchronize(s_);
  EXPECT_NO_THROW(cuda_check_errors(*comm_));
  const auto ref = tpnorm_test::batch_norm_eval_reference(
      xb, n, c, inner, gb, bb, {rm.begin(), rm.end()}, {rv.begin(), rv.end()}, opt.eps, {});
  const double rt = tpnorm_test::storage_rtol(DType::F32);
  const int64_t wrong = q.wrong() + tpnorm_test::count_wrong("bn y", y.floats(), ref.y, rt, rt);
  EXPECT_EQ(tpnorm_test::sum_over_ranks(wrong), 0);
}

// Past the strict calls a bad argument on rank 1 is found on device: the accepting ranks' apply
// kernels, the residual epilogue included, write nothing.
TEST_P(GpuInFlight, RejectedFusedBackwardLeavesDfAndDxBitIdentical) {
  const int P = tpnorm_test::world_size(), me = tpnorm_test::world_rank();
  if (P < 2) GTEST_SKIP() << "a call rejected on device needs a second rank";
  comm_->set_strict_calls(0);
  const int64_t rows = 16, h = 300;
  const auto v = [&](uint64_t st, int64_t n) {
    return Buffer(DType::F32, tpnorm_test::normal(37, st, n));
  };
  DBuf dy(v(0, rows * h)), dhx(v(1, rows * h)), hh(v(2, rows * h)), gamma(v(3, h));
  DBuf rstd(Buffer(DType::F32, std::vector<float>(rows, 1.0f)));
  DBuf dx(v(4, rows * h)), df(v(5, rows * h)), dg(v(6, h));
  const std::vector<float> dx0 = dx.floats(), df0 = df.floats();
  const Shape s{rows, h};
  // Rank 1's dx has one column too few: its own local failure.
  const Shape sdx = me == 1 ? Shape{rows, h - 1} : s;
  bool threw = false;
  try {
    fused_add_rms_norm_backward(*comm_, dy.view(s), dhx.view(s), hh.view(s), gamma.view({h}),
                                rstd.view({rows}), 1.0, dx.view(sdx), df.view(s), dg.view({h}));
    cudaStreamSynchronize(s_);
    cuda_check_errors(*comm_);
  } catch (const Error&) {
    threw = true;
  }
  EXPECT_TRUE(threw) << "rank " << me << ": the rejected call was not reported";
  const std::vector<float> dx1 = dx.floats(), df1 = df.floats();
  int64_t changed = 0;
  for (size_t i = 0; i < dx0.size(); ++i)
    changed += std::memcmp(&dx0[i], &dx1[i], 4) != 0 || std::memcmp(&df0[i], &df1[i], 4) != 0;
  EXPECT_EQ(tpnorm_test::sum_over_ranks(changed), 0) << "df / dx elements written, all ranks";
}

// num_batches_tracked and the cumulative momentum 1 / num_batches_tracked advance only for an
// accepted call, as on CPU; a rejected call leaves the counter and the running statistics as
// they were; capturing such a call is refused before anything is captured.
TEST_P(GpuInFlight, BatchNormCounterAdvancesOnlyWhenAccepted) {
  const int P = tpnorm_test::world_size(), me = tpnorm_test::world_rank();
  const int64_t c = 3;
  auto run = [&](int64_t n, int64_t inner, bool bad, int64_t* tracked,
                 std::vector<float>* rm_out) {
    const auto xb = tpnorm_test::normal(38, 0, n * c * inner, 2.0, 1.0);
    DBuf x(Buffer(DType::F32, xb)), y(Buffer(DType::F32, std::vector<float>(n * c * inner)));
    DBuf rm(Buffer(DType::F32, *rm_out)), rv(Buffer(DType::F32, std::vector<float>(c, 1.f)));
    BatchNormOptions opt;
    opt.momentum = std::nan("");  // cumulative: m = 1 / num_batches_tracked
    const Shape sx{n, c, inner}, sc{c};
    const Shape sy = bad ? Shape{n, c, inner - 1} : sx;
    try {
      sync_batch_norm_forward(*comm_, x.view(sx), {}, {}, rm.view(sc), rv.view(sc), tracked,
                              y.view(sy), {}, {}, opt);
      cudaStreamSynchronize(s_);
      cuda_check_errors(*comm_);
    } catch (const Error&) {
      *rm_out = rm.floats();
      return false;
    }
    *rm_out = rm.floats();
    return true;
  };
  comm_->set_strict_calls(0);  // the device path after the strict calls
  int64_t tracked = 4;
  std::vector<float> rm(c, 7.f);
  EXPECT_TRUE(run(2, 10, false, &tracked, &rm));
  EXPECT_EQ(tracked, 5);
  EXPECT_NE(rm[0], 7.f) << "an accepted call updates the running mean (momentum 1/5)";
  const std::vector<float> before = rm;
  // Rejected: one rank's bad y (P > 1), or one value per channel over all ranks (P = 1).
  const bool ok = P > 1 ? run(2, 10, me == 1, &tracked, &rm) : run(1, 1, false, &tracked, &rm);
  EXPECT_FALSE(ok) << "rank " << me;
  EXPECT_EQ(tracked, 5) << "a rejected call advanced num_batches_tracked";
  EXPECT_EQ(std::memcmp(before.data(), rm.data(), c * sizeof(float)), 0)
      << "a rejected call changed the running mean";
  // Capture: refused with an error, the counter unchanged.
  const int64_t inner = 10;
  const auto xb = tpnorm_test::normal(39, 0, 2 * c * inner);
  DBuf x(Buffer(DType::F32, xb)), y(Buffer(DType::F32, xb));
  DBuf rmd(Buffer(DType::F32, rm)), rvd(Buffer(DType::F32, std::vector<float>(c, 1.f)));
  const Shape sx{2, c, inner}, sc{c};
  TPNORM_CUDA_OK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeRelaxed));
  bool refused = false;
  try {
    sync_batch_norm_forward(*comm_, x.view(sx), {}, {}, rmd.view(sc), rvd.view(sc), &tracked,
                            y.view(sx), {}, {}, BatchNormOptions{});
  } catch (const Error& e) {
    refused =
        e.code() == ErrorCode::kInvalidArgument && std::strstr(e.what(), "captured") != nullptr;
  }
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(s_, &graph);
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();
  EXPECT_TRUE(refused);
  EXPECT_EQ(tracked, 5);
}

// Stats::kNaive's float32 wire counts exactly only below 2^24 values per channel: a training
// call of 2^24 values over all ranks is refused on the host, with the host path's message and
// the same error on every rank, before anything changes (counter, cumulative momentum, y,
// running statistics); 2^24 - 1 values are accepted and counted.
TEST_P(GpuInFlight, NaiveBatchNormOf2To24ValuesIsRefusedBeforeTheCounter) {
  const int P = tpnorm_test::world_size(), me = tpnorm_test::world_rank();
  auto run = [&](int64_t total, int64_t* tracked, std::string* error) {
    const int64_t inner = tpnorm_test::split_even(total, P).count[me];  // one channel, n = 1
    DBuf x(Buffer(DType::F32, std::vector<float>(inner, 1.f)));  // sums exact in float32
    DBuf y(Buffer(DType::F32, std::vector<float>(inner, -7.f)));
    DBuf rm(Buffer(DType::F32, std::vector<float>(1, 7.f)));
    DBuf rv(Buffer(DType::F32, std::vector<float>(1, 3.f)));
    BatchNormOptions opt;
    opt.stats = Stats::kNaive;
    opt.momentum = std::nan("");  // cumulative: the momentum comes from the counter
    const Shape s{1, 1, inner}, c{1};
    error->clear();
    try {
      sync_batch_norm_forward(*comm_, x.view(s), {}, {}, rm.view(c), rv.view(c), tracked,
                              y.view(s), {}, {}, opt);
      cudaStreamSynchronize(s_);
      cuda_check_errors(*comm_);
    } catch (const Error& e) {
      *error = e.what();
    }
    const std::vector<float> yh = y.floats();
    int64_t y_changed = 0;
    for (float v : yh) y_changed += v != -7.f;
    return std::make_tuple(y_changed, rm.floats()[0], rv.floats()[0]);
  };
  int64_t tracked = 4;
  std::string error;
  const auto [y_changed, rm, rv] = run(int64_t{1} << 24, &tracked, &error);
  EXPECT_NE(error.find("fewer than 2^24 elements per channel"), std::string::npos)
      << "rank " << me << ": " << (error.empty() ? "accepted" : error);
  EXPECT_EQ(tracked, 4) << "a refused call advanced num_batches_tracked";
  EXPECT_EQ(y_changed, 0) << "a refused call wrote y";
  EXPECT_EQ(rm, 7.f) << "a refused call changed the running mean";
  EXPECT_EQ(rv, 3.f) << "a refused call changed the running variance";
  // The same message on every rank.
  std::vector<char> mine(256, 0), first(256, 0);
  std::strncpy(mine.data(), error.c_str(), mine.size() - 1);
  first = mine;
  MPI_Bcast(first.data(), static_cast<int>(first.size()), MPI_CHAR, 0, MPI_COMM_WORLD);
  EXPECT_EQ(std::string(mine.data()), std::string(first.data())) << "rank " << me;
  // Just below the limit: accepted, counted, written.
  const auto [y2, rm2, rv2] = run((int64_t{1} << 24) - 1, &tracked, &error);
  EXPECT_TRUE(error.empty()) << error;
  EXPECT_EQ(tracked, 5);
  EXPECT_GT(y2, 0);
  EXPECT_NE(rm2, 7.f);
  (void)rv2;
}

INSTANTIATE_TEST_SUITE_P(Staged, GpuInFlight, ::testing::Values(Kind::kStaged));
INSTANTIATE_TEST_SUITE_P(Nccl, GpuInFlight, ::testing::Values(Kind::kNccl));

// Growth that capture forbids is a misuse: an exception, on a single-GPU communicator too (no
// peer to strand), never the end of the process.
TEST(GpuCaptureGrowth, SingleCommunicatorThrowsInsteadOfEndingTheProcess) {
  TPNORM_REQUIRE_GPU();
  if (tpnorm_test::world_rank() != 0) return;
  cudaStream_t s = nullptr;
  cudaSetDevice(local_cuda_device(MPI_COMM_WORLD));
  TPNORM_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  {
    auto gpu = make_cuda_single_communicator(s, local_cuda_device(MPI_COMM_WORLD));
    gpu->set_strict_calls(0);
    const int64_t rows = 20000, h = 64;  // a payload far past the pool's first 64 KiB
    DBuf x(Buffer(DType::F32, tpnorm_test::normal(40, 0, rows * h)));
    DBuf y(Buffer(DType::F32, std::vector<float>(rows * h))), r(Buffer(DType::F32, rows));
    TPNORM_CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
    bool threw = false;
    try {
      rms_norm_forward(*gpu, x.view({rows, h}), {}, y.view({rows, h}), r.view({rows}));
    } catch (const Error& e) {
      threw = e.code() == ErrorCode::kInvalidArgument;
    }
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(s, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    EXPECT_TRUE(threw) << "no tpnorm::Error for growth during capture";
    // The communicator still works outside the capture.
    EXPECT_NO_THROW(
        rms_norm_forward(*gpu, x.view({rows, h}), {}, y.view({rows, h}), r.view({rows})));
    EXPECT_NO_THROW(cuda_check_errors(*gpu));
  }
  cudaStreamDestroy(s);
}

}  // namespace
