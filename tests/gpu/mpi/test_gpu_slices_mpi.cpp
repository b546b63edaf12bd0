// Slices that do not tile, on device communicators (the MPI-staged one, any number of ranks on
// the visible GPUs): every rank passing its whole rows to a LayerNorm with hidden_size (the
// summed count is P * h, not h), and every rank at channel offset 0 of a GroupNorm and of the
// gated RMSNorm (the counts add up, the slices overlap). Each call is rejected on every rank
// alike: by a host check that throws, or by the device's (the header's count against
// Header::count_want; the summed slice table), which leaves every output untouched and which
// cuda_check_errors reports. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>

#include "gpu_checks.h"
#include "tpnorm/cuda.h"
#include "tpnorm/cuda_mpi.h"
#include "tpnorm/error.h"
#include "tpnorm/group_norm.h"
#include "tpnorm/mpi.h"
#include "tpnorm/rms_norm_gated.h"

using namespace tpnorm;
using namespace tpnorm_gpu;
using tpnorm_test::Buffer;

namespace {

// Runs `call` twice (a strict call, then one past the strict calls) and counts on this rank
// what went wrong: each call must either throw naming `needle` (a check on the host) or, not
// throwing, be reported by cuda_check_errors (the device's check); every rank alike; `out` must
// still hold 42 everywhere.
int64_t rejected_everywhere(Communicator& gpu, const std::function<void()>& call, DevBuf& out,
                            const char* needle, std::string* msg) {
  int64_t bad = 0;
  for (int strict = 1; strict >= 0; --strict) {
    if (!strict) gpu.set_strict_calls(0);
    int threw = 0;
    try {
      call();
    } catch (const Error& e) {
      threw = 1;
      *msg = e.what();
      if (!std::strstr(e.what(), needle)) ++bad;
    }
    if (!threw) {
      try {
        cuda_check_errors(gpu);
        ++bad;  // neither the call nor the device rejected it
      } catch (const Error&) {
      }
    }
    const int64_t all = tpnorm_test::sum_over_ranks(threw);
    if (all != 0 && all != tpnorm_test::world_size()) ++bad;  // some ranks threw, some not
  }
  for (float v : out.floats()) bad += v != 42.f;
  return bad;
}

struct Staged {
  cudaStream_t s = nullptr;
  std::unique_ptr<Communicator> gpu;
  int dev = 0;
  Staged() {
    dev = local_cuda_device(MPI_COMM_WORLD);
    cudaSetDevice(dev);
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    gpu = make_mpi_staged_cuda_communicator(MPI_COMM_WORLD, s, dev);
  }
  ~Staged() {
    gpu.reset();
    cudaStreamDestroy(s);
  }
};

TEST(GpuSlices, WholeRowsOnEveryRankAreRejected) {
  TPNORM_REQUIRE_GPU();
  const int P = tpnorm_test::world_size(), me = tpnorm_test::world_rank();
  if (P < 2) GTEST_SKIP() << "needs 2 ranks";
  Staged st;
  const int64_t R = 4, h = 16;
  const Shape sh{R, h}, r{R};
  DevBuf x(Buffer(DType::F32, tpnorm_test::normal(5, me, R * h)), false, st.dev),
      y(Buffer(DType::F32, std::vector<float>(R * h, 42.f)), false, st.dev),
      mean(Buffer(DType::F32, R), false, st.dev), rstd(Buffer(DType::F32, R), false, st.dev);
  NormOptions opt;
  opt.hidden_size = h;  // each rank passes all h columns: the slices add up to P * h
  std::string msg;
  const int64_t bad = rejected_everywhere(
      *st.gpu,
      [&] {
        layer_norm_forward(*st.gpu, x.view(sh), {}, {}, y.view(sh), mean.view(r), rstd.view(r),
                           opt);
      },
      y, "hidden size", &msg);
  EXPECT_EQ(tpnorm_test::sum_over_ranks(bad), 0) << "rank " << me << ": " << msg;
}

TEST(GpuSlices, OverlappingChannelSlicesAreRejected) {
  TPNORM_REQUIRE_GPU();
  const int P = tpnorm_test::world_size(), me = tpnorm_test::world_rank();
  if (P < 2) GTEST_SKIP() << "needs 2 ranks";
  Staged st;
  const int64_t N = 2, c = 2, S = 3, C = c * P;  // every rank at offset 0: [0, c) P times
  const Shape xs{N, c, S}, stats{N, 2};
  DevBuf x(Buffer(DType::F32, tpnorm_test::normal(6, me, N * c * S)), false, st.dev),
      y(Buffer(DType::F32, std::vector<float>(N * c * S, 42.f)), false, st.dev),
      mean(Buffer(DType::F32, N * 2), false, st.dev), rstd(Buffer(DType::F32, N * 2), false, st.dev);
  std::string msg;
  int64_t bad = rejected_everywhere(
      *st.gpu,
      [&] {
        group_norm_forward(*st.gpu, x.view(xs), ChannelGroups{2, C, 0}, {}, {}, y.view(xs),
                           mean.view(stats), rstd.view(stats));
      },
      y, "held by more than one rank", &msg);
  EXPECT_EQ(tpnorm_test::sum_over_ranks(bad), 0) << "rank " << me << ": " << msg;

  Staged st2;  // a fresh communicator: strict calls again
  const int64_t rows = 3;
  const Shape gs{rows, c}, gr{rows, P};
  DevBuf gx(Buffer(DType::F32, tpnorm_test::normal(7, me, rows * c)), false, st2.dev),
      gy(Buffer(DType::F32, std::vector<float>(rows * c, 42.f)), false, st2.dev),
      grstd(Buffer(DType::F32, rows * P), false, st2.dev);
  bad = rejected_everywhere(
      *st2.gpu,
      [&] {
        rms_norm_gated_forward(*st2.gpu, gx.view(gs), gx.view(gs), GatedGroups{c, C, 0, false},
                               {}, gy.view(gs), grstd.view(gr));
      },
      gy, "held by more than one rank", &msg);
  EXPECT_EQ(tpnorm_test::sum_over_ranks(bad), 0) << "rank " << me << ": " << msg;
}

}  // namespace
