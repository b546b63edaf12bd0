// cuda_comm.cpp — device-memory communicators: single GPU, NCCL (borrowed or made from an
// MPI_Comm), and MPI staged through pinned host memory. See tpnorm/cuda.h for what each call
// may and may not do (no host synchronisation, allocation or MPI call in the steady state).
#include <mpi.h>

#include <algorithm>
#include <string>

#include "comm/cuda/cuda_check.h"
#include "comm/device_comm.h"
#include "comm/mpi_check.h"
#include "kernels/cuda/row_norm.h"
#include "tpnorm/cuda_mpi.h"
#include "tpnorm/error.h"

namespace tpnorm {
namespace {

// Stream, device workspace and device error word: what every device communicator shares.
class CudaCommBase : public detail::DeviceCommunicator {
 public:
  CudaCommBase(cudaStream_t stream, int device) : stream_(stream), device_(device) {
    detail::DeviceGuard g(device_);
    TPNORM_CHECK(CUDA, cudaMalloc(&err_, 256));
    TPNORM_CHECK(CUDA, cudaMemset(err_, 0, 256));
  }
  ~CudaCommBase() override {
    // cudaFree waits for work that may still use the buffers; errors cannot be thrown here.
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    if (ws_) cudaFree(ws_);
    if (err_) cudaFree(err_);
    cudaSetDevice(prev);
  }
  Device device() const override { return Device::cuda(device_); }
  void* stream() const override { return stream_; }
  int device_index() const override { return device_; }
  int* error_word() override { return static_cast<int*>(err_); }

  void* workspace(size_t bytes) override {
    if (bytes <= cap_ && ws_) return ws_;
    if (capturing())
      throw Error(ErrorCode::kInvalidArgument,
                  "tpnorm: the device workspace must grow to " + std::to_string(bytes) +
                      " bytes while the stream is being captured; run the call once before "
                      "capturing it, or call tpnorm::cuda_reserve_workspace");
    detail::DeviceGuard g(device_);
    TPNORM_CHECK(CUDA, cudaStreamSynchronize(stream_));  // earlier calls may still use it
    if (ws_) TPNORM_CHECK(CUDA, cudaFree(ws_));
    ws_ = nullptr;
    const size_t n = std::max<size_t>({bytes, 2 * cap_, size_t{1} << 16});
    cap_ = 0;
    TPNORM_CHECK(CUDA, cudaMalloc(&ws_, n));
    cap_ = n;
    return ws_;
  }

  void enqueue_header(void* base, DType wire, const double* header, size_t nh,
                      size_t zero_values) override {
    kernels::cuda::write_header(base, wire == DType::F64, header, static_cast<int>(nh),
                                zero_values, stream_);
  }

 protected:
  bool capturing() const {
    cudaStreamCaptureStatus s = cudaStreamCaptureStatusNone;
    TPNORM_CHECK(CUDA, cudaStreamIsCapturing(stream_, &s));
    return s != cudaStreamCaptureStatusNone;
  }

  cudaStream_t stream_;
  int device_;

 private:
  void* ws_ = nullptr;
  size_t cap_ = 0;
  void* err_ = nullptr;
};

class CudaSingleCommunicator final : public CudaCommBase {
 public:
  using CudaCommBase::CudaCommBase;
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void control_all_reduce_sum(double*, size_t) override {}  // the sum over one rank

 protected:
  void do_all_reduce_sum(void*, size_t, DType) override {}
};

MPI_Datatype mpi_type(DType t) {
  if (t == DType::F64) return MPI_DOUBLE;
  if (t == DType::F32) return MPI_FLOAT;
  throw Error(ErrorCode::kInvalidArgument,
              std::string("tpnorm: MPI all_reduce_sum supports fp32 and fp64 buffers, not ") +
                  dtype_name(t));
}

// An MPI duplicate of the caller's communicator, for control (and staged) traffic.
struct MpiDup {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  explicit MpiDup(MPI_Comm parent) {
    TPNORM_CHECK(MPI, MPI_Comm_dup(parent, &comm));
    TPNORM_CHECK(MPI, MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    TPNORM_CHECK(MPI, MPI_Comm_rank(comm, &rank));
    TPNORM_CHECK(MPI, MPI_Comm_size(comm, &size));
  }
  ~MpiDup() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
  void sum(void* buf, size_t count, DType t) const {
    constexpr size_t kChunk = size_t{1} << 30;  // MPI counts are int
    char* p = static_cast<char*>(buf);
    for (size_t done = 0; done < count; done += kChunk) {
      const size_t n = std::min(kChunk, count - done);
      TPNORM_CHECK(MPI, MPI_Allreduce(MPI_IN_PLACE, p + done * dtype_size(t),
                                      static_cast<int>(n), mpi_type(t), MPI_SUM, comm));
    }
  }
};

// Device buffer -> pinned host -> MPI_Allreduce -> device. The stream synchronisation makes
// this the one communicator that is not graph-capturable; it exists so that several ranks can
// share one GPU (NCCL refuses that).
class MpiStagedCommunicator final : public CudaCommBase {
 public:
  MpiStagedCommunicator(MPI_Comm comm, cudaStream_t stream, int device)
      : CudaCommBase(stream, device), mpi_(comm) {}
  ~MpiStagedCommunicator() override {
    if (host_) {
      cudaStreamSynchronize(stream_);
      cudaFreeHost(host_);
    }
  }
  int rank() const override { return mpi_.rank; }
  int size() const override { return mpi_.size; }
  void control_all_reduce_sum(double* buf, size_t n) override { mpi_.sum(buf, n, DType::F64); }

 protected:
  void do_all_reduce_sum(void* buf, size_t count, DType dtype) override {
    if (capturing())
      throw Error(ErrorCode::kInvalidArgument,
                  "tpnorm: the MPI-staged device communicator cannot be captured in a CUDA graph");
    detail::DeviceGuard g(device_);
    const size_t bytes = count * dtype_size(dtype);
    TPNORM_CHECK(CUDA, cudaStreamSynchronize(stream_));
    if (bytes > host_cap_) {
      if (host_) TPNORM_CHECK(CUDA, cudaFreeHost(host_));
      host_ = nullptr;
      host_cap_ = 0;
      TPNORM_CHECK(CUDA, cudaMallocHost(&host_, bytes));
      host_cap_ = bytes;
    }
    TPNORM_CHECK(CUDA, cudaMemcpyAsync(host_, buf, bytes, cudaMemcpyDeviceToHost, stream_));
    TPNORM_CHECK(CUDA, cudaStreamSynchronize(stream_));
    mpi_.sum(host_, count, dtype);
    TPNORM_CHECK(CUDA, cudaMemcpyAsync(buf, host_, bytes, cudaMemcpyHostToDevice, stream_));
  }

 private:
  MpiDup mpi_;
  void* host_ = nullptr;
  size_t host_cap_ = 0;
};

#ifdef TPNORM_WITH_NCCL
ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F64: return ncclFloat64;
    case DType::F16: return ncclFloat16;
    case DType::BF16: return ncclBfloat16;
    default: return ncclFloat32;
  }
}

int nccl_device(ncclComm_t c) {
  int d = 0;
  TPNORM_CHECK(NCCL, ncclCommCuDevice(c, &d));
  return d;
}

// ncclAllReduce on the caller's stream. Owns the ncclComm_t only when tpnorm made it.
class NcclCommunicator final : public CudaCommBase {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, bool own, MPI_Comm control)
      : CudaCommBase(stream, nccl_device(comm)), comm_(comm), own_(own) {
    TPNORM_CHECK(NCCL, ncclCommUserRank(comm_, &rank_));
    TPNORM_CHECK(NCCL, ncclCommCount(comm_, &size_));
    if (control != MPI_COMM_NULL) mpi_ = std::make_unique<MpiDup>(control);
  }
  ~NcclCommunicator() override {
    if (ctrl_) cudaFree(ctrl_);
    if (own_) ncclCommDestroy(comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  // MPI when the communicator came from an MPI_Comm; else NCCL plus a stream synchronisation
  // (strict calls and diagnoses only, never in the steady state).
  void control_all_reduce_sum(double* buf, size_t n) override {
    if (mpi_) return mpi_->sum(buf, n, DType::F64);
    if (capturing())
      throw Error(ErrorCode::kInvalidArgument,
                  "tpnorm: a strict call (host-side agreement check) cannot be captured in a "
                  "CUDA graph; call Communicator::set_strict_calls(0) or capture later calls");
    detail::DeviceGuard g(device_);
    const size_t bytes = n * sizeof(double);
    if (bytes > ctrl_cap_) {
      TPNORM_CHECK(CUDA, cudaStreamSynchronize(stream_));
      if (ctrl_) TPNORM_CHECK(CUDA, cudaFree(ctrl_));
      ctrl_ = nullptr;
      ctrl_cap_ = 0;
      TPNORM_CHECK(CUDA, cudaMalloc(&ctrl_, bytes));
      ctrl_cap_ = bytes;
    }
    TPNORM_CHECK(CUDA, cudaMemcpyAsync(ctrl_, buf, bytes, cudaMemcpyHostToDevice, stream_));
    TPNORM_CHECK(NCCL, ncclAllReduce(ctrl_, ctrl_, n, ncclFloat64, ncclSum, comm_, stream_));
    TPNORM_CHECK(CUDA, cudaMemcpyAsync(buf, ctrl_, bytes, cudaMemcpyDeviceToHost, stream_));
    TPNORM_CHECK(CUDA, cudaStreamSynchronize(stream_));
  }

 protected:
  void do_all_reduce_sum(void* buf, size_t count, DType dtype) override {
    TPNORM_CHECK(NCCL,
                 ncclAllReduce(buf, buf, count, nccl_type(dtype), ncclSum, comm_, stream_));
  }

 private:
  ncclComm_t comm_;
  bool own_;
  int rank_ = 0, size_ = 1;
  std::unique_ptr<MpiDup> mpi_;
  void* ctrl_ = nullptr;
  size_t ctrl_cap_ = 0;
};
#endif

}  // namespace

std::unique_ptr<Communicator> make_cuda_single_communicator(cudaStream_t stream, int device) {
  return std::make_unique<CudaSingleCommunicator>(stream, device);
}

std::unique_ptr<Communicator> make_mpi_staged_cuda_communicator(MPI_Comm comm,
                                                                cudaStream_t stream, int device) {
  return std::make_unique<MpiStagedCommunicator>(comm, stream, device);
}

int local_cuda_device(MPI_Comm comm) {
  MPI_Comm node = MPI_COMM_NULL;
  int rank = 0, local = 0, count = 0;
  TPNORM_CHECK(MPI, MPI_Comm_rank(comm, &rank));
  TPNORM_CHECK(MPI, MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
  const int rc = MPI_Comm_rank(node, &local);
  MPI_Comm_free(&node);
  TPNORM_CHECK(MPI, rc);
  TPNORM_CHECK(CUDA, cudaGetDeviceCount(&count));
  return count > 0 ? local % count : 0;
}

#ifdef TPNORM_WITH_NCCL
std::unique_ptr<Communicator> make_nccl_communicator(ncclComm_t comm, cudaStream_t stream) {
  return std::make_unique<NcclCommunicator>(comm, stream, false, MPI_COMM_NULL);
}

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, cudaStream_t stream) {
  const int device = local_cuda_device(comm);
  TPNORM_CHECK(CUDA, cudaSetDevice(device));
  int rank = 0, size = 1;
  TPNORM_CHECK(MPI, MPI_Comm_rank(comm, &rank));
  TPNORM_CHECK(MPI, MPI_Comm_size(comm, &size));
  // Rank 0's id and whether it got one: the other ranks must not wait for an id that failed.
  struct {
    int ok;
    ncclUniqueId id;
  } msg{};
  if (rank == 0) msg.ok = ncclGetUniqueId(&msg.id) == ncclSuccess ? 1 : 0;
  TPNORM_CHECK(MPI, MPI_Bcast(&msg, sizeof msg, MPI_BYTE, 0, comm));
  if (!msg.ok) throw Error(ErrorCode::kCommunication, "tpnorm: ncclGetUniqueId failed on rank 0");
  TPNORM_CHECK(MPI, MPI_Barrier(comm));
  ncclComm_t nc = nullptr;
  TPNORM_CHECK(NCCL, ncclCommInitRank(&nc, size, msg.id, rank));
  return std::make_unique<NcclCommunicator>(nc, stream, true, comm);
}
#endif

void cuda_check_errors(Communicator& comm) {
  auto* d = dynamic_cast<detail::DeviceCommunicator*>(&comm);
  if (!d) return;
  detail::DeviceGuard g(d->device_index());
  const auto s = static_cast<cudaStream_t>(d->stream());
  int flag = 0;
  TPNORM_CHECK(CUDA, cudaStreamSynchronize(s));
  TPNORM_CHECK(CUDA, cudaMemcpy(&flag, d->error_word(), sizeof flag, cudaMemcpyDeviceToHost));
  if (!flag) return;
  TPNORM_CHECK(CUDA, cudaMemset(d->error_word(), 0, sizeof flag));
  throw Error(ErrorCode::kMismatch,
              "tpnorm: a device call on rank " + std::to_string(comm.rank()) +
                  " found a rank that failed or ranks that disagree on the call; its outputs "
                  "were left untouched (run with Communicator::set_strict_calls(-1) for the "
                  "host-side diagnosis)");
}

void cuda_reserve_workspace(Communicator& comm, size_t bytes) {
  if (auto* d = dynamic_cast<detail::DeviceCommunicator*>(&comm)) d->workspace(bytes);
}

}  // namespace tpnorm
