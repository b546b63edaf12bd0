// The host side of device calls under mpiexec at 3 ranks (host test: no GPU needed). A device
// communicator whose "device memory" is host memory and whose control all-reduce is MPI drives
// the device path of PackedCall and run_op up to the device work, where every rank must
// already agree on the call's verdict:
// - a rank whose device workspace cannot be had (an allocation that fails in a strict call)
//   still joins the host check of the call: every rank throws the same tpnorm::Error, instead
//   of that rank throwing alone and its peers waiting in the control all-reduce;
// - a captured call whose workspace would have to grow on one rank only (uneven shards) fails
//   on every rank with that rank's message, before any rank captures the collective;
// - a call captured while a started call's sums are in flight is refused on every rank before
//   anything of it is captured.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "comm/device_comm.h"
#include "harness.h"
#include "ops/packed_call.h"
#include "tpnorm/cuda.h"
#include "tpnorm/error.h"
#include "tpnorm/norm.h"

using namespace tpnorm;

namespace {

// A control all-reduce that never completes is this test's failure: its deadline ends the
// job with a message (a hang would only end at ctest's limit).
constexpr double kControlDeadlineS = 20;

// Device communicator over MPI_COMM_WORLD with host memory; acquire_workspace fails on
// `failing_rank` every time it is asked, as cudaMalloc would (kCommunication), or as the pool
// does when it must grow while the stream is captured (kInvalidArgument).
class HostBackedDevice final : public detail::DeviceCommunicator {
 public:
  explicit HostBackedDevice(int failing_rank, ErrorCode how = ErrorCode::kCommunication)
      : failing_rank_(failing_rank), how_(how) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  ~HostBackedDevice() override {
    for (void* p : blocks_) std::free(p);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cuda(0); }
  void* acquire_workspace(size_t bytes) override {
    ++acquires_;
    if (rank_ == failing_rank_)
      throw Error(how_, how_ == ErrorCode::kInvalidArgument
                            ? "test: the workspace must grow while the stream is captured"
                            : "test: cudaMalloc: out of memory");
    blocks_.push_back(std::calloc(1, bytes));
    return blocks_.back();
  }
  void release_workspace(void*) override {}
  int* error_word() override { return &error_word_; }
  void control_all_reduce_sum(double* buf, size_t n) override {
    ++control_sums_;
    MPI_Request r;
    MPI_Iallreduce(MPI_IN_PLACE, buf, static_cast<int>(n), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD,
                   &r);
    const auto end = std::chrono::steady_clock::now() +
                     std::chrono::duration<double>(kControlDeadlineS);
    for (int done = 0;;) {
      MPI_Test(&r, &done, MPI_STATUS_IGNORE);
      if (done) return;
      if (std::chrono::steady_clock::now() > end)
        abort_job("rank " + std::to_string(rank_) +
                  ": a peer never joined the control all-reduce (it threw alone)");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  void poison(void*, size_t, bool) override {}
  bool capturing() const override { return capturing_; }
  int device_index() const override { return 0; }
  [[noreturn]] void abort_job(const std::string& message) override {
    std::fprintf(stderr, "FAIL: %s\n", message.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    std::abort();
  }
  int acquires_ = 0, control_sums_ = 0, collectives_ = 0;
  bool capturing_ = false;

 protected:
  // The "device" collective, on host memory (F64 only: the tests' own sums).
  void do_all_reduce_sum(void* buf, size_t n, DType t) override {
    ++collectives_;
    ASSERT_EQ(t, DType::F64);
    MPI_Allreduce(MPI_IN_PLACE, buf, static_cast<int>(n), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  }

 private:
  int rank_ = 0, size_ = 1, failing_rank_;
  ErrorCode how_;
  int error_word_ = 0;
  std::vector<void*> blocks_;
};

struct Outcome {
  bool threw = false;
  int code = -1;
  std::string message;
};

template <class Fn>
Outcome outcome_of(Fn&& fn) {
  Outcome o;
  try {
    fn();
  } catch (const Error& e) {
    o.threw = true;
    o.code = static_cast<int>(e.code());
    o.message = e.what();
  }
  return o;
}

// Every rank threw, with rank 0's code and message.
void expect_same_error_everywhere(const Outcome& o) {
  EXPECT_TRUE(o.threw) << "rank " << tpnorm_test::world_rank() << " did not throw";
  char mine[1024] = {}, first[1024] = {};
  std::strncpy(mine, o.message.c_str(), sizeof mine - 1);
  std::memcpy(first, mine, sizeof first);
  MPI_Bcast(first, sizeof first, MPI_CHAR, 0, MPI_COMM_WORLD);
  int code0 = o.code;
  MPI_Bcast(&code0, 1, MPI_INT, 0, MPI_COMM_WORLD);
  const int same = std::strcmp(mine, first) == 0 && o.code == code0 && o.threw;
  int all = 0;
  MPI_Allreduce(&same, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(all, tpnorm_test::world_size())
      << "rank " << tpnorm_test::world_rank() << " got \"" << mine << "\", rank 0 got \""
      << first << "\"";
}

// A strict call whose workspace cannot be had on rank 1 (run_op's prepare_device records that
// as the rank's failure): the header's host check, then the reduce. Rank 1 must not ask the
// device for memory again before that check (it would throw alone); every rank throws the
// diagnosis naming rank 1.
void strict_call_with_failed_workspace(bool header_first) {
  if (tpnorm_test::world_size() < 2) GTEST_SKIP() << "needs a second rank";
  HostBackedDevice dev(/*failing_rank=*/1);
  dev.set_strict_calls(-1);
  const Outcome o = outcome_of([&] {
    detail::PackedCall call(dev, "test_device_call", DType::F32, true);
    try {
      call.prepare(8, 10, 256);
    } catch (const Error& e) {
      call.fail(std::string("the device workspace could not grow: ") + e.what(),
                ErrorCode::kCommunication);
    }
    if (header_first)
      call.check_header_first();  // a chunked call's runner
    else
      call.start_reduce();
  });
  expect_same_error_everywhere(o);
  EXPECT_EQ(dev.collectives_, 0) << "a failed call reached the device collective";
  EXPECT_NE(o.message.find("rank 1: the device workspace could not grow"), std::string::npos)
      << o.message;
  EXPECT_EQ(o.code, static_cast<int>(ErrorCode::kCommunication));
  EXPECT_EQ(dev.control_sums_, 2) << "the header's check and the diagnosis";
  if (tpnorm_test::world_rank() == 1) {
    EXPECT_EQ(dev.acquires_, 1) << "asked for memory again";
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(GpuDeviceCallHost, FailedWorkspaceJoinsTheStrictCheckOfTheReduce) {
  strict_call_with_failed_workspace(false);
}

TEST(GpuDeviceCallHost, FailedWorkspaceJoinsTheStrictCheckOfTheHeaderFirst) {
  strict_call_with_failed_workspace(true);
}

// An RMSNorm forward whose views name the communicator's device (host memory here).
struct RmsViews {
  int64_t rows, h;
  std::vector<float> x, y, rstd;
  RmsViews(int64_t r, int64_t h_) : rows(r), h(h_), x(r * h_, 1.f), y(r * h_), rstd(r) {}
  void call(Communicator& comm) {
    const Device d = Device::cuda(0);
    rms_norm_forward(comm, TensorView(x.data(), DType::F32, Shape{rows, h}, d), {},
                     TensorView(y.data(), DType::F32, Shape{rows, h}, d),
                     TensorView(rstd.data(), DType::F32, Shape{rows}, d));
  }
};

bool gpu_visible() {
  int n = 0;
  const bool yes = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return yes;
}

// Capture growth on rank 1 only (uneven shards): every rank throws, with rank 1's message,
// after the host check of the header and before the device collective. The other ranks' partial
// kernels cannot run on host memory: on a machine without a GPU their launch fails (a failure
// of theirs too); with a GPU visible this host-memory case is not run.
TEST(GpuDeviceCallHost, CaptureGrowthOnOneRankIsEveryRanksError) {
  if (tpnorm_test::world_size() < 2) GTEST_SKIP() << "needs a second rank";
  if (gpu_visible()) GTEST_SKIP() << "a GPU is visible: this host-memory case needs none";
  HostBackedDevice dev(/*failing_rank=*/1, ErrorCode::kInvalidArgument);
  dev.set_strict_calls(0);  // past the strict calls: the capture alone makes the call strict
  dev.capturing_ = true;
  RmsViews v(4, 8);
  const Outcome o = outcome_of([&] { v.call(dev); });
  expect_same_error_everywhere(o);
  EXPECT_NE(o.message.find("rank 1: test: the workspace must grow while the stream is captured"),
            std::string::npos)
      << o.message;
  EXPECT_EQ(dev.collectives_, 0) << "a rank captured the collective of a failed call";
  EXPECT_EQ(dev.control_sums_, 2) << "the header's check and the diagnosis";
  MPI_Barrier(MPI_COMM_WORLD);
}

// A started call's sum in flight, then a captured call: refused on every rank with
// kInvalidArgument before anything of it (workspace, host check, collective) happens.
TEST(GpuDeviceCallHost, CaptureWhileASumIsInFlightIsRefusedEverywhere) {
  HostBackedDevice dev(/*failing_rank=*/-1);
  double one = 1;
  Communicator::Request r = dev.start_all_reduce_sum(&one, 1, DType::F64);
  const int collectives = dev.collectives_;
  dev.capturing_ = true;
  RmsViews v(4, 8);
  const Outcome o = outcome_of([&] { v.call(dev); });
  dev.capturing_ = false;
  dev.wait(r);
  expect_same_error_everywhere(o);
  EXPECT_EQ(o.code, static_cast<int>(ErrorCode::kInvalidArgument));
  EXPECT_NE(o.message.find("while a started call's sums are in flight"), std::string::npos)
      << o.message;
  EXPECT_EQ(dev.acquires_, 0);
  EXPECT_EQ(dev.control_sums_, 0);
  EXPECT_EQ(dev.collectives_, collectives);
  EXPECT_EQ(one, tpnorm_test::world_size());
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
