// cuda_comm.cpp — device-memory communicators: single GPU, NCCL (borrowed or made from an
// MPI_Comm), and MPI staged through pinned host memory. See tpnorm/cuda.h for what each call
// may and may not do (no host synchronisation, allocation or MPI call in the steady state).
//
// Never stranding a peer. Once a rank is inside a call's collective the others rely on it
// joining theirs, so between the ops' prepare and the collective nothing here throws:
//   * a header whose write could not be launched is overwritten with all-ones bits (NaN,
//     poison()), which every rank's apply kernels reject; the rank joins, then throws;
//   * a rank that cannot join at all (its workspace could not grow to the call's length after
//     the strict calls, or the transport failed) ends the job at once with a message instead;
//   * every collective is watched: the NCCL one by a host thread (watchdog.h), the MPI-staged
//     one by polling MPI_Iallreduce / the stream against the deadline. An overdue collective
//     ends the job with the watchdog's message (ncclCommAbort or MPI_Abort, exit status 124)
//     within Communicator::timeout().
#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/cuda/watchdog.h"
#include "comm/cuda/workspace.h"
#include "comm/device_comm.h"
#include "comm/mpi_check.h"
#include "comm/mpi_util.h"
#include "common/cuda_check.h"
#include "tpnorm/cuda_mpi.h"
#include "tpnorm/error.h"

namespace tpnorm {
namespace {

// Same exit status as `timeout` (and as the MPI communicator's watchdog): out of time.
constexpr int kWatchdogExitCode = 124;

// Polls done() until it is true (returns true) or `timeout_s` has passed (returns false);
// timeout_s <= 0 waits forever. Reading the clock every 64th poll keeps it off short waits.
template <class Done>
bool poll_until(double timeout_s, Done&& done) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  for (unsigned i = 1;; ++i) {
    if (done()) return true;
    if (timeout_s > 0 && i % 64 == 0 && clock::now() > deadline) return false;
    std::this_thread::yield();
  }
}

void print_line(const std::string& m) {
  std::fprintf(stderr, "%s\n", m.c_str());
  std::fflush(stderr);
}

// Stream, device workspace and device error word: what every device communicator shares.
class CudaCommBase : public detail::DeviceCommunicator {
 public:
  CudaCommBase(cudaStream_t stream, int device)
      : stream_(stream),
        device_(device),
        ws_(
            [this](size_t n) {
              detail::DeviceGuard g(device_);
              void* p = nullptr;
              TPNORM_CHECK(CUDA, cudaMalloc(&p, n));
              return p;
            },
            [](void* p) { cudaFree(p); }) {
    detail::DeviceGuard g(device_);
    TPNORM_CHECK(CUDA, cudaMalloc(&err_, 256));
    // On the communicator's stream, like every later access of the word: a clear on the
    // legacy stream would be unordered with the kernels that set it.
    TPNORM_CHECK(CUDA, cudaMemsetAsync(err_, 0, 256, stream_));
  }
  ~CudaCommBase() override {
    // Errors cannot be thrown here; the stream is drained before its memory goes.
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    ws_.release_all();
    if (err_) cudaFree(err_);
    cudaSetDevice(prev);
  }
  Device device() const override { return Device::cuda(device_); }
  void* stream() const override { return stream_; }
  int device_index() const override { return device_; }
  int* error_word() override { return static_cast<int*>(err_); }

  void* acquire_workspace(size_t bytes) override { return ws_.acquire(bytes, capturing()); }
  void release_workspace(void* region) override { ws_.release(region); }
  void reserve_workspace(size_t bytes) {
    if (capturing())
      throw Error(ErrorCode::kInvalidArgument,
                  "tpnorm: cuda_reserve_workspace cannot allocate while the stream is being "
                  "captured; reserve before capturing");
    ws_.reserve(bytes);
  }

  // Never throws: it runs between the header's failed launch and the collective.
  void poison(void* base, size_t bytes, bool int64) override {
    bool ok = cudaMemsetAsync(base, int64 ? 0 : 0xff, bytes, stream_) == cudaSuccess;
    if (ok && int64)  // byte kInt64PoisonByte of every 8-byte word: kInt64Poison
      ok = cudaMemset2DAsync(static_cast<char*>(base) + detail::kInt64PoisonByte, 8, 1, 1,
                             bytes / 8, stream_) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();
  }

 protected:
  bool capturing() const override {
    cudaStreamCaptureStatus s = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_, &s) != cudaSuccess) return false;
    return s != cudaStreamCaptureStatusNone;
  }
  /// False when `bytes` at `buf` (workspace memory) exceed the workspace: the rank could not
  /// grow it for this call and cannot join a collective of the length the others use.
  bool joinable(const void* buf, size_t bytes) const {
    return !ws_.owns(buf) || ws_.fits(buf, bytes);
  }
  std::string cannot_join_message(size_t bytes) const {
    return "tpnorm: rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
           ": cannot join the collective (" + std::to_string(bytes) +
           " bytes; the device workspace could not grow to it): ending the job, the other "
           "ranks would wait for it forever";
  }

  cudaStream_t stream_;
  int device_;

 private:
  detail::Workspace ws_;
  void* err_ = nullptr;
};

class CudaSingleCommunicator final : public CudaCommBase {
 public:
  using CudaCommBase::CudaCommBase;
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void control_all_reduce_sum(double*, size_t) override {}  // the sum over one rank
  [[noreturn]] void abort_job(const std::string& message) override {
    print_line(message);
    std::_Exit(kWatchdogExitCode);
  }

 protected:
  void do_all_reduce_sum(void*, size_t, DType) override {}  // the sum over one rank
};

using detail::mpi_type;

// An MPI duplicate of the caller's communicator, for control (and staged) traffic. sum() is
// MPI_Iallreduce polled with MPI_Test against the deadline; overdue() is called (it ends the
// job) when the peers never join.
struct MpiDup {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  MpiDup() = default;
  explicit MpiDup(MPI_Comm parent) { connect(parent); }
  /// Collective over parent (MPI_Comm_dup): every rank's local set-up is agreed before it.
  void connect(MPI_Comm parent) { detail::dup_comm(parent, &comm, &rank, &size); }
  ~MpiDup() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
  template <class Overdue>
  void sum(void* buf, size_t count, DType t, double timeout_s, Overdue&& overdue) const {
    constexpr size_t kChunk = size_t{1} << 30;  // MPI counts are int
    char* p = static_cast<char*>(buf);
    for (size_t done = 0; done < count; done += kChunk) {
      const size_t n = std::min(kChunk, count - done);
      MPI_Request req;
      TPNORM_CHECK(MPI, MPI_Iallreduce(MPI_IN_PLACE, p + done * dtype_size(t), static_cast<int>(n),
                                       mpi_type(t), MPI_SUM, comm, &req));
      int rc = MPI_SUCCESS;
      const bool in_time = poll_until(timeout_s, [&] {
        int flag = 0;
        rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
        return rc != MPI_SUCCESS || flag != 0;
      });
      if (!in_time) overdue();
      TPNORM_CHECK(MPI, rc);
    }
  }
};

// Ends the job from the calling (main) thread: the MPI communicators' watchdog rule.
[[noreturn]] void mpi_abort_job(const std::string& message) {
  print_line(message);
  MPI_Abort(MPI_COMM_WORLD, kWatchdogExitCode);
  std::_Exit(kWatchdogExitCode);  // MPI_Abort does not return; if it did, still end
}

// Device buffer -> pinned host -> MPI all-reduce -> device. The stream synchronisation makes
// this the one communicator that is not graph-capturable; it exists so that several ranks can
// share one GPU (NCCL refuses that). Waits (stream and MPI) are polled against timeout().
class MpiStagedCommunicator final : public CudaCommBase {
 public:
  /// Local steps only (device, error word); connect() then joins the peers.
  MpiStagedCommunicator(cudaStream_t stream, int device) : CudaCommBase(stream, device) {}
  void connect(MPI_Comm comm) { mpi_.connect(comm); }
  ~MpiStagedCommunicator() override {
    if (host_) {
      cudaStreamSynchronize(stream_);
      cudaFreeHost(host_);
    }
  }
  int rank() const override { return mpi_.rank; }
  int size() const override { return mpi_.size; }
  void control_all_reduce_sum(double* buf, size_t n) override {
    mpi_.sum(buf, n, DType::F64, timeout(), [&] { mpi_abort_job(watchdog_message()); });
  }
  [[noreturn]] void abort_job(const std::string& message) override { mpi_abort_job(message); }

 protected:
  void do_all_reduce_sum(void* buf, size_t count, DType dtype) override {
    if (capturing())
      throw Error(ErrorCode::kInvalidArgument,
                  "tpnorm: the MPI-staged device communicator cannot be captured in a CUDA graph");
    detail::DeviceGuard g(device_);
    const size_t bytes = count * dtype_size(dtype);
    if (!joinable(buf, bytes)) mpi_abort_job(cannot_join_message(bytes));
    wait_stream();
    if (bytes > host_cap_) {
      if (host_) cudaFreeHost(host_);
      host_ = nullptr;
      host_cap_ = 0;
      if (cudaMallocHost(&host_, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        host_ = nullptr;
        mpi_abort_job(cannot_join_message(bytes) + " (pinned host memory)");
      }
      host_cap_ = bytes;
    }
    stream_call(cudaMemcpyAsync(host_, buf, bytes, cudaMemcpyDeviceToHost, stream_));
    wait_stream();
    mpi_.sum(host_, count, dtype, timeout(), [&] { mpi_abort_job(watchdog_message()); });
    stream_call(cudaMemcpyAsync(buf, host_, bytes, cudaMemcpyHostToDevice, stream_));
  }

 private:
  // The stream's earlier work (the partial kernels) must finish before the copy is read; a
  // stream that never finishes, or fails, would leave the peers in MPI: end the job.
  void wait_stream() {
    cudaError_t e = cudaSuccess;
    const bool in_time = poll_until(timeout(), [&] {
      e = cudaStreamQuery(stream_);
      return e != cudaErrorNotReady;
    });
    if (!in_time) mpi_abort_job(watchdog_message() + " (waiting for the device stream)");
    if (e != cudaSuccess)
      mpi_abort_job("tpnorm: rank " + std::to_string(rank()) +
                    ": the device stream failed before the collective (" +
                    detail::CUDA_error_string(e) + "): ending the job");
  }
  void stream_call(cudaError_t e) {
    if (e != cudaSuccess)
      mpi_abort_job("tpnorm: rank " + std::to_string(rank()) +
                    ": a copy for the collective failed (" + detail::CUDA_error_string(e) +
                    "): ending the job");
  }

  MpiDup mpi_;
  void* host_ = nullptr;
  size_t host_cap_ = 0;
};

/// The device of `stream`, or -1 for the legacy / per-thread default stream (which runs on
/// whatever device is current when work is enqueued).
int stream_device(cudaStream_t stream) {
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) return -1;
  int d = -1;
  TPNORM_CHECK(CUDA, cudaStreamGetDevice(stream, &d));
  return d;
}

void check_stream_device(cudaStream_t stream, int device) {
  const int sd = stream_device(stream);
  if (sd >= 0 && sd != device)
    throw Error(ErrorCode::kInvalidArgument,
                "tpnorm: the stream belongs to CUDA device " + std::to_string(sd) +
                    " but the communicator is on device " + std::to_string(device) +
                    "; create the stream on the communicator's device (cudaSetDevice first)");
}

// The factories' agreement order: every step that can fail on one rank (choosing the device,
// the stream's device, device memory, NCCL's queries, the watchdog thread) runs first, then
// every rank learns whether any rank failed it; only then comes a step that waits for peers
// (MPI_Comm_dup, ncclCommInitRank). If one rank failed, all throw the first failing rank's
// message, so that no rank waits in a later step for it.
void agree_or_throw(MPI_Comm comm, const std::string& local_error, const char* factory,
                    const char* step) {
  int me = 0;
  TPNORM_CHECK(MPI, MPI_Comm_rank(comm, &me));
  int first = local_error.empty() ? INT_MAX : me;
  TPNORM_CHECK(MPI, MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, comm));
  if (first == INT_MAX) return;
  char msg[512] = {};
  if (me == first) std::strncpy(msg, local_error.c_str(), sizeof msg - 1);
  TPNORM_CHECK(MPI, MPI_Bcast(msg, sizeof msg, MPI_CHAR, first, comm));
  throw Error(ErrorCode::kCommunication, std::string("tpnorm: ") + factory + ": " + step +
                                             " failed on rank " + std::to_string(first) + ": " +
                                             msg);
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}
#ifdef TPNORM_WITH_NCCL
ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F64:
      return ncclFloat64;
    case DType::I64:
      return ncclInt64;
    case DType::F16:
      return ncclFloat16;
    case DType::BF16:
      return ncclBfloat16;
    default:
      return ncclFloat32;
  }
}

// A non-blocking communicator (ncclConfig_t::blocking = 0, e.g. a caller's) may answer
// ncclInProgress: the operation is still being set up. Polls ncclCommGetAsyncError until it
// settles, for at most timeout_s (then returns ncclInProgress).
ncclResult_t settle(ncclComm_t comm, ncclResult_t r, double timeout_s) {
  if (r != ncclInProgress) return r;
  poll_until(timeout_s, [&] {
    if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) r = ncclInternalError;
    return r != ncclInProgress;
  });
  return r;
}

int nccl_device(ncclComm_t c) {
  int d = 0;
  TPNORM_CHECK(NCCL, settle(c, ncclCommCuDevice(c, &d), 0));
  return d;
}

// ncclAllReduce on the caller's stream, watched by a Watchdog thread. Owns the ncclComm_t
// only when tpnorm made it.
class NcclCommunicator final : public CudaCommBase {
 public:
  /// Local steps only; attach_control() then joins the peers over MPI when the communicator
  /// was made from an MPI_Comm.
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, bool own)
      : CudaCommBase(stream, nccl_device(comm)), comm_(comm), own_(own) {
    check_stream_device(stream, device_);
    TPNORM_CHECK(NCCL, settle(comm_, ncclCommUserRank(comm_, &rank_), 0));
    TPNORM_CHECK(NCCL, settle(comm_, ncclCommCount(comm_, &size_), 0));
    detail::Watchdog::Hooks h;
    h.on_start = [this] {
      cudaSetDevice(device_);
      // Relaxed: the queries below stay legal while the caller captures a graph in global
      // mode on another thread (and cannot invalidate that capture).
      cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed;
      cudaThreadExchangeStreamCaptureMode(&m);
    };
    h.probe = [this](uint64_t t, std::string* why) {
      const cudaError_t e = cudaEventQuery(event(t));
      if (e == cudaSuccess) return detail::Watchdog::State::kDone;
      if (e == cudaErrorNotReady) return detail::Watchdog::State::kPending;
      *why = detail::CUDA_error_string(e);
      return detail::Watchdog::State::kFailed;
    };
    h.release = [this](uint64_t t) {
      std::lock_guard<std::mutex> g(ev_mu_);
      free_events_.push_back(t);
    };
    h.async_error = [this]() -> std::string {
      ncclResult_t r = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &r) != ncclSuccess || r == ncclSuccess ||
          r == ncclInProgress)
        return {};
      return "tpnorm watchdog: rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
             ": NCCL reported an asynchronous error: " + detail::NCCL_error_string(r) +
             "; aborting the job";
    };
    h.describe = [this](const char* op, uint64_t seq) { return watchdog_message(op, seq); };
    h.fire = [this](const std::string& m) { end_job(m); };
    watchdog_ = std::make_unique<detail::Watchdog>(std::move(h));
    // The stream of the non-blocking sums (see do_start_all_reduce_sum); without it they run
    // on the caller's stream, as blocking ones do.
    {
      detail::DeviceGuard g(device_);
      int least = 0, greatest = 0;
      if (cudaDeviceGetStreamPriorityRange(&least, &greatest) != cudaSuccess ||
          cudaStreamCreateWithPriority(&side_, cudaStreamNonBlocking, greatest) != cudaSuccess) {
        (void)cudaGetLastError();
        side_ = nullptr;
      }
    }
  }
  ~NcclCommunicator() override {
    {
      // Drain the streams while the watchdog still watches them: a collective that a peer
      // never joins ends the job with the watchdog's message instead of hanging here.
      int prev = 0;
      cudaGetDevice(&prev);
      cudaSetDevice(device_);
      for (cudaStream_t st : {stream_, side_})
        if (st) poll_until(0, [&] { return cudaStreamQuery(st) != cudaErrorNotReady; });
      (void)cudaGetLastError();
      cudaSetDevice(prev);
    }
    watchdog_.reset();  // joins its thread before anything it touches goes
    {
      int prev = 0;
      cudaGetDevice(&prev);
      cudaSetDevice(device_);
      cudaStreamSynchronize(stream_);
      if (side_) {
        cudaStreamSynchronize(side_);
        cudaStreamDestroy(side_);
      }
      for (auto& p : started_) cudaEventDestroy(p.second);
      for (cudaEvent_t e : spare_) cudaEventDestroy(e);
      for (cudaEvent_t e : events_) cudaEventDestroy(e);
      old_ctrl_.push_back({ctrl_, ctrl_host_});
      for (const auto& b : old_ctrl_) {
        if (b.first) cudaFree(b.first);
        if (b.second) cudaFreeHost(b.second);
      }
      cudaSetDevice(prev);
    }
    if (own_) destroy_owned();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  [[noreturn]] void abort_job(const std::string& message) override { end_job(message); }
  /// Collective over `control` (MPI_Comm_dup): the strict pre-check and diagnoses go over it.
  void attach_control(MPI_Comm control) { mpi_ = std::make_unique<MpiDup>(control); }

  bool control_while_capturing() const override { return mpi_ != nullptr; }
  // MPI when the communicator came from an MPI_Comm; else NCCL plus a polled wait on the
  // stream (strict calls and diagnoses only, never in the steady state).
  void control_all_reduce_sum(double* buf, size_t n) override {
    if (mpi_) return mpi_->sum(buf, n, DType::F64, timeout(), [&] { end_job(watchdog_message()); });
    if (capturing())
      throw Error(ErrorCode::kInvalidArgument,
                  "tpnorm: a strict call (host-side agreement check) cannot be captured in a "
                  "CUDA graph; call Communicator::set_strict_calls(0) or capture later calls");
    detail::DeviceGuard g(device_);
    const size_t bytes = n * sizeof(double);
    // Every host-side wait here is bounded by the watchdog's timeout. The host side of both
    // copies is pinned: a copy from or into pageable memory returns only once it is done,
    // i.e. after the stream's earlier work and the all-reduce, so a peer that never joins
    // would hang this rank inside cudaMemcpyAsync, before the polled wait below. Buffers that
    // are outgrown are kept until the destructor: freeing them would synchronise the device.
    if (bytes > ctrl_cap_) {
      void* dev = nullptr;
      void* host = nullptr;
      TPNORM_CHECK(CUDA, cudaMalloc(&dev, bytes));
      if (cudaMallocHost(&host, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        cudaFree(dev);
        throw Error(ErrorCode::kCommunication,
                    "tpnorm: no pinned host memory for the control all-reduce");
      }
      if (ctrl_) old_ctrl_.push_back({ctrl_, ctrl_host_});
      ctrl_ = dev;
      ctrl_host_ = host;
      ctrl_cap_ = bytes;
    }
    std::memcpy(ctrl_host_, buf, bytes);
    TPNORM_CHECK(CUDA, cudaMemcpyAsync(ctrl_, ctrl_host_, bytes, cudaMemcpyHostToDevice, stream_));
    after_side_sums();
    collective(ctrl_, n, ncclFloat64);
    TPNORM_CHECK(CUDA, cudaMemcpyAsync(ctrl_host_, ctrl_, bytes, cudaMemcpyDeviceToHost, stream_));
    cudaError_t e = cudaSuccess;
    const bool in_time = poll_until(timeout(), [&] {
      e = cudaStreamQuery(stream_);
      return e != cudaErrorNotReady;
    });
    if (!in_time) end_job(watchdog_message() + " (the host-side check of the call)");
    TPNORM_CHECK(CUDA, e);
    std::memcpy(buf, ctrl_host_, bytes);
  }

 protected:
  void do_all_reduce_sum(void* buf, size_t count, DType dtype) override {
    const size_t bytes = count * dtype_size(dtype);
    if (!joinable(buf, bytes)) end_job(cannot_join_message(bytes));
    after_side_sums();
    collective(buf, count, nccl_type(dtype));
    watch();
  }

  // Non-blocking sums (a chunked call's chunks, ops/chunking.h) run on the side stream: it waits
  // for an event that marks the caller's stream now (the chunk's partial), runs the all-reduce,
  // and records `done`; wait() makes the caller's stream wait for `done`. No host
  // synchronisation: the caller's stream runs the next chunk's partial while this sum is in
  // flight. Sums keep their issue order (one side stream), and a blocking collective issued
  // while side sums are outstanding waits for them on the device (after_side_sums), so every
  // rank's NCCL operations stay in the order the ranks issued them.
  void do_start_all_reduce_sum(uint64_t id, void* buf, size_t count, DType dtype) override {
    if (!side_) return do_all_reduce_sum(buf, count, dtype);
    const size_t bytes = count * dtype_size(dtype);
    if (!joinable(buf, bytes)) end_job(cannot_join_message(bytes));
    detail::DeviceGuard g(device_);
    cudaEvent_t ready = spare_event(), done = spare_event();
    side_call(cudaEventRecord(ready, stream_));
    side_call(cudaStreamWaitEvent(side_, ready, 0));
    spare_.push_back(ready);  // reusable: the wait above took its state when it was enqueued
    collective(buf, count, nccl_type(dtype), side_);
    side_call(cudaEventRecord(done, side_));
    watch(side_);
    started_.emplace_back(id, done);
  }
  void do_wait(uint64_t id) override {
    for (auto it = started_.begin(); it != started_.end(); ++it) {
      if (it->first != id) continue;
      detail::DeviceGuard g(device_);
      side_call(cudaStreamWaitEvent(stream_, it->second, 0));
      spare_.push_back(it->second);
      started_.erase(it);
      return;
    }
  }

 private:
  // The caller's stream waits (on the device) for every side sum not yet waited.
  void after_side_sums() {
    if (started_.empty()) return;
    side_call(cudaStreamWaitEvent(stream_, started_.back().second, 0));
  }
  cudaEvent_t spare_event() {
    if (!spare_.empty()) {
      cudaEvent_t e = spare_.back();
      spare_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    side_call(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  // A side sum's event or wait that could not be enqueued: the peers are (or will be) inside
  // the collective, so end the job as for a failed collective.
  void side_call(cudaError_t e) {
    if (e == cudaSuccess) return;
    end_job("tpnorm: rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
            ": ordering a non-blocking sum on the device failed (" + detail::CUDA_error_string(e) +
            "); aborting the job (the other ranks cannot finish the collective)");
  }

  // Enqueues the all-reduce; a failure here leaves the peers inside theirs: end the job.
  void collective(void* buf, size_t count, ncclDataType_t type, cudaStream_t on = nullptr) {
    const ncclResult_t r = settle(
        comm_, ncclAllReduce(buf, buf, count, type, ncclSum, comm_, on ? on : stream_), timeout());
    if (r == ncclSuccess) return;
    end_job(r == ncclInProgress
                ? watchdog_message()
                : "tpnorm: rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
                      ": ncclAllReduce failed: " + detail::NCCL_error_string(r) +
                      "; aborting the job (the other ranks cannot finish the collective)");
  }

  // An event after the collective, for the watchdog thread (not while capturing: a replay is
  // not enqueued by tpnorm, and the event would become part of the graph).
  void watch(cudaStream_t on = nullptr) {
    if (!on) on = stream_;
    if (!(timeout() > 0) || capturing()) return;
    uint64_t t = 0;
    {
      std::lock_guard<std::mutex> g(ev_mu_);
      if (free_events_.empty()) {
        cudaEvent_t e = nullptr;
        if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
          (void)cudaGetLastError();
          return;  // unwatched, but the call itself is fine
        }
        events_.push_back(e);
        free_events_.push_back(events_.size() - 1);
      }
      t = free_events_.back();
      free_events_.pop_back();
    }
    if (cudaEventRecord(event(t), on) != cudaSuccess) {
      (void)cudaGetLastError();
      std::lock_guard<std::mutex> g(ev_mu_);
      free_events_.push_back(t);
      return;
    }
    watchdog_->watch(t, timeout(), current_op(), sequence());
  }

  cudaEvent_t event(uint64_t t) {
    std::lock_guard<std::mutex> g(ev_mu_);
    return events_[t];
  }

  // tpnorm's own communicators are non-blocking (make_nccl_communicator): finalize, wait for
  // it within the watchdog's timeout, then destroy; a finalize that does not settle (a peer
  // gone) is aborted instead of hanging the destructor.
  void destroy_owned() {
    const ncclResult_t r = settle(comm_, ncclCommFinalize(comm_), timeout());
    if (r == ncclSuccess)
      ncclCommDestroy(comm_);
    else
      ncclCommAbort(comm_);
  }

  // The watchdog's end of the job, from either thread: message, abort NCCL (so that no kernel
  // of this rank keeps waiting), exit. mpirun then ends the other ranks.
  [[noreturn]] void end_job(const std::string& message) {
    print_line(message);
    ncclCommAbort(comm_);
    std::_Exit(kWatchdogExitCode);
  }

  ncclComm_t comm_;
  bool own_;
  int rank_ = 0, size_ = 1;
  std::unique_ptr<MpiDup> mpi_;
  void* ctrl_ = nullptr;       // device side of the control all-reduce
  void* ctrl_host_ = nullptr;  // its pinned host side
  size_t ctrl_cap_ = 0;
  std::vector<std::pair<void*, void*>> old_ctrl_;  // outgrown {device, host} buffers
  std::mutex ev_mu_;
  std::vector<cudaEvent_t> events_;
  std::vector<uint64_t> free_events_;
  // Non-blocking sums: their stream, the `done` event of each sum not yet waited (by request
  // id, in issue order), and events free for reuse.
  cudaStream_t side_ = nullptr;
  std::vector<std::pair<uint64_t, cudaEvent_t>> started_;
  std::vector<cudaEvent_t> spare_;
  std::unique_ptr<detail::Watchdog> watchdog_;  // last: its thread uses the members above
};

#endif

}  // namespace

std::unique_ptr<Communicator> make_cuda_single_communicator(cudaStream_t stream, int device) {
  return std::make_unique<CudaSingleCommunicator>(stream, device);
}

std::unique_ptr<Communicator> make_mpi_staged_cuda_communicator(MPI_Comm comm, cudaStream_t stream,
                                                                int device) {
  constexpr const char* kName = "make_mpi_staged_cuda_communicator";
  // 1. Local: the device, the stream's device, the error word. 2. Agreed. 3. MPI_Comm_dup.
  std::unique_ptr<MpiStagedCommunicator> made;
  agree_or_throw(comm, error_of([&] {
                   int count = 0;
                   TPNORM_CHECK(CUDA, cudaGetDeviceCount(&count));
                   if (device < 0 || device >= count)
                     throw Error(ErrorCode::kInvalidArgument,
                                 "device " + std::to_string(device) + " is not one of the " +
                                     std::to_string(count) + " visible CUDA devices");
                   check_stream_device(stream, device);
                   made = std::make_unique<MpiStagedCommunicator>(stream, device);
                 }),
                 kName, "setting up the device");
  made->connect(comm);
  return made;
}

namespace {
// This rank's rank among the ranks of `comm` on its node (collective over comm).
int node_local_rank(MPI_Comm comm) {
  MPI_Comm node = MPI_COMM_NULL;
  int rank = 0, local = 0;
  TPNORM_CHECK(MPI, MPI_Comm_rank(comm, &rank));
  TPNORM_CHECK(MPI, MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
  const int rc = MPI_Comm_rank(node, &local);
  MPI_Comm_free(&node);
  TPNORM_CHECK(MPI, rc);
  return local;
}
}  // namespace

int local_cuda_device(MPI_Comm comm) {
  const int local = node_local_rank(comm);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) (void)cudaGetLastError(), count = 0;
  return count > 0 ? local % count : 0;
}

#ifdef TPNORM_WITH_NCCL
std::unique_ptr<Communicator> make_nccl_communicator(ncclComm_t comm, cudaStream_t stream) {
  return std::make_unique<NcclCommunicator>(comm, stream, false);
}

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, cudaStream_t stream,
                                                     int device) {
  int rank = 0, size = 1;
  TPNORM_CHECK(MPI, MPI_Comm_rank(comm, &rank));
  TPNORM_CHECK(MPI, MPI_Comm_size(comm, &size));
  // 1. Each rank's local checks, agreed on before anyone waits for anyone.
  agree_or_throw(comm, error_of([&] {
                   int count = 0;
                   TPNORM_CHECK(CUDA, cudaGetDeviceCount(&count));
                   if (device < 0 || device >= count)
                     throw Error(ErrorCode::kInvalidArgument,
                                 "device " + std::to_string(device) + " is not one of the " +
                                     std::to_string(count) + " visible CUDA devices");
                   check_stream_device(stream, device);
                   TPNORM_CHECK(CUDA, cudaSetDevice(device));
                 }),
                 "make_nccl_communicator", "choosing the device");
  // 2. Rank 0's unique id; whether it got one travels with it.
  struct {
    int ok;
    ncclUniqueId id;
  } msg{};
  if (rank == 0) msg.ok = ncclGetUniqueId(&msg.id) == ncclSuccess ? 1 : 0;
  TPNORM_CHECK(MPI, MPI_Bcast(&msg, sizeof msg, MPI_BYTE, 0, comm));
  if (!msg.ok)
    throw Error(ErrorCode::kCommunication,
                "tpnorm: make_nccl_communicator: ncclGetUniqueId failed on rank 0");
  // 3. ncclCommInitRank (it waits for the peers; every rank reached it), agreed. Non-blocking
  // and polled against the watchdog's timeout (TPNORM_TIMEOUT): a peer that fails or stops
  // inside NCCL's bootstrap would otherwise leave this rank there forever; an overdue init is
  // aborted and becomes this rank's error, which every rank then throws.
  ncclComm_t nc = nullptr;
  std::string err = error_of([&] {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const double limit = Communicator::default_timeout();
    const ncclResult_t r =
        settle(nc, ncclCommInitRankConfig(&nc, size, msg.id, rank, &config), limit);
    if (r == ncclInProgress)
      throw Error(ErrorCode::kCommunication,
                  "ncclCommInitRank did not finish within " + std::to_string(limit) +
                      " s (TPNORM_TIMEOUT): a rank did not reach it or failed inside it");
    TPNORM_CHECK(NCCL, r);
  });
  if (!err.empty() && nc) ncclCommAbort(nc), nc = nullptr;
  try {
    agree_or_throw(comm, err, "make_nccl_communicator", "ncclCommInitRank");
  } catch (...) {
    if (nc) ncclCommAbort(nc);
    throw;
  }
  // 4. The local set-up of the communicator (device memory, the watchdog thread), agreed.
  std::unique_ptr<NcclCommunicator> made;
  err = error_of([&] { made = std::make_unique<NcclCommunicator>(nc, stream, true); });
  if (!made) ncclCommAbort(nc);  // the constructor threw: nothing owns nc
  try {
    agree_or_throw(comm, err, "make_nccl_communicator", "setting up the communicator");
  } catch (...) {
    made.reset();
    throw;
  }
  // 5. The MPI control channel (MPI_Comm_dup, every rank reaches it).
  made->attach_control(comm);
  return made;
}

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, cudaStream_t stream) {
  int local = 0, count = 0;
  std::string err = error_of([&] {
    local = node_local_rank(comm);
    TPNORM_CHECK(CUDA, cudaGetDeviceCount(&count));
  });
  // One visible GPU per rank (CUDA_VISIBLE_DEVICES set per rank by the launcher): device 0.
  // Else the node-local rank, which must have a GPU of its own (NCCL refuses sharing).
  const int device = count == 1 ? 0 : local;
  if (err.empty() && count > 1 && local >= count)
    err = "node-local rank " + std::to_string(local) + " has no GPU of its own (" +
          std::to_string(count) +
          " visible); use one rank per GPU, or "
          "make_mpi_staged_cuda_communicator to share a GPU";
  agree_or_throw(comm, err, "make_nccl_communicator", "finding this rank's GPU");
  return make_nccl_communicator(comm, stream, device);
}
#endif

void cuda_check_errors(Communicator& comm) {
  auto* d = dynamic_cast<detail::DeviceCommunicator*>(&comm);
  if (!d) return;
  detail::DeviceGuard g(d->device_index());
  const auto s = static_cast<cudaStream_t>(d->stream());
  int flag = 0;
  // The stream's calls (their collectives) first, waited for against the watchdog's timeout: a
  // peer that never joins ends the job with the watchdog's message instead of hanging here.
  cudaError_t e = cudaSuccess;
  if (!poll_until(comm.timeout(), [&] {
        e = cudaStreamQuery(s);
        return e != cudaErrorNotReady;
      }))
    d->abort_job("tpnorm watchdog: rank " + std::to_string(comm.rank()) + " of " +
                 std::to_string(comm.size()) + ": cuda_check_errors waited more than " +
                 std::to_string(comm.timeout()) +
                 " s for the stream's device calls (a peer that never joined a collective?); "
                 "ending the job");
  TPNORM_CHECK(CUDA, e);
  // Read and clear in stream order, after every call enqueued before this check.
  TPNORM_CHECK(CUDA,
               cudaMemcpyAsync(&flag, d->error_word(), sizeof flag, cudaMemcpyDeviceToHost, s));
  TPNORM_CHECK(CUDA, cudaStreamSynchronize(s));
  if (!flag) return;
  TPNORM_CHECK(CUDA, cudaMemsetAsync(d->error_word(), 0, sizeof flag, s));
  TPNORM_CHECK(CUDA, cudaStreamSynchronize(s));
  throw Error(ErrorCode::kMismatch,
              "tpnorm: a device call on rank " + std::to_string(comm.rank()) +
                  " found a rank that failed or ranks that disagree on the call; its outputs "
                  "were left untouched (run with Communicator::set_strict_calls(-1) for the "
                  "host-side diagnosis)");
}

void cuda_reserve_workspace(Communicator& comm, size_t bytes) {
  if (auto* d = dynamic_cast<CudaCommBase*>(&comm)) d->reserve_workspace(bytes);
}

}  // namespace tpnorm
