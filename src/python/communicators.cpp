// communicators.cpp — see communicators.h.
#include "communicators.h"

#include <mpi.h>

#include <string>

#include "dlpack.h"
#include "tensor_args.h"
#include "tpnorm/error.h"
#include "tpnorm/mpi.h"
#ifdef TPNORM_WITH_NCCL
#include "common/cuda_check.h"
#include "tpnorm/cuda.h"
#endif

namespace py = pybind11;

namespace tpnorm::python {
namespace {

// A DLPack capsule over `count` elements at `buf` that never frees `buf` (tpnorm owns it).
struct BufferTensor {
  DLManagedTensor managed;
  int64_t shape[1];
};

void delete_buffer_tensor(DLManagedTensor* m) { delete static_cast<BufferTensor*>(m->manager_ctx); }

py::capsule buffer_capsule(void* buf, size_t count, DType dtype) {
  auto* b = new BufferTensor{};
  b->shape[0] = static_cast<int64_t>(count);
  DLTensor& t = b->managed.dl_tensor;
  t.data = buf;
  t.device = {kDLCPU, 0};
  t.ndim = 1;
  const uint8_t bits = dtype == DType::F32 ? 32 : 64;
  t.dtype = {dtype == DType::I64 ? uint8_t{kDLInt} : uint8_t{kDLFloat}, bits, 1};
  t.shape = b->shape;
  b->managed.manager_ctx = b;
  b->managed.deleter = delete_buffer_tensor;
  // A capsule nobody consumed still frees the struct; a consumer renames it "used_dltensor".
  return py::capsule(&b->managed, "dltensor", [](PyObject* cap) {
    if (PyCapsule_IsValid(cap, "dltensor")) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
      m->deleter(m);
    }
  });
}

class CallbackCommunicator final : public Communicator {
 public:
  CallbackCommunicator(int rank, int size, py::function fn)
      : rank_(rank), size_(size), fn_(std::move(fn)) {}
  ~CallbackCommunicator() override {
    py::gil_scoped_acquire gil;  // the Python function is released under the GIL
    fn_ = py::function();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cpu(); }

 protected:
  void do_all_reduce_sum(void* buf, size_t count, DType dtype) override {
    if (dtype != DType::F32 && dtype != DType::F64 && dtype != DType::I64)
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("tpnorm: process-group all_reduce_sum takes fp32, fp64 or int64 ") +
                      "(Stats::kExact), not " + dtype_name(dtype));
    py::gil_scoped_acquire gil;
    try {
      fn_(buffer_capsule(buf, count, dtype));
    } catch (py::error_already_set& e) {
      throw Error(ErrorCode::kCommunication,
                  std::string("tpnorm: the process group's all_reduce failed: ") + error_text(e));
    }
  }

 private:
  int rank_, size_;
  py::function fn_;
};

}  // namespace

std::shared_ptr<Communicator> mpi_communicator(int64_t fortran_handle) {
  int init = 0;
  MPI_Initialized(&init);
  if (!init)
    throw Error(ErrorCode::kInvalidArgument,
                "tpnorm: MPI is not initialised (import mpi4py.MPI first)");
  MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_handle));
  if (comm == MPI_COMM_NULL)
    throw Error(ErrorCode::kInvalidArgument, "tpnorm: the MPI communicator is MPI_COMM_NULL");
  return make_mpi_communicator(comm);
}

std::shared_ptr<Communicator> callback_communicator(int rank, int size, py::function fn) {
  if (size < 1 || rank < 0 || rank >= size)
    throw Error(ErrorCode::kInvalidArgument, "tpnorm: rank " + std::to_string(rank) +
                                                 " is not in a group of " + std::to_string(size));
  return std::make_shared<CallbackCommunicator>(rank, size, std::move(fn));
}

#ifdef TPNORM_WITH_NCCL
namespace {
void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess)
    throw Error(ErrorCode::kCommunication,
                std::string("tpnorm: ") + what + " failed: " + ncclGetErrorString(r));
}
}  // namespace

bool has_nccl() { return true; }

py::bytes nccl_unique_id() {
  ncclUniqueId id;
  nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return py::bytes(id.internal, sizeof(id.internal));
}

std::shared_ptr<Communicator> nccl_communicator(py::bytes unique_id, int rank, int size, int device,
                                                uintptr_t stream) {
  const std::string raw = unique_id;
  ncclUniqueId id;
  if (raw.size() != sizeof(id.internal))
    throw Error(ErrorCode::kInvalidArgument,
                "tpnorm: an ncclUniqueId has " + std::to_string(sizeof(id.internal)) + " bytes");
  std::copy(raw.begin(), raw.end(), id.internal);
  // ncclCommInitRank takes the current device; the caller's is restored after, as torch's
  // own calls leave it.
  ncclComm_t nccl = nullptr;
  {
    const detail::DeviceGuard guard(device);
    py::gil_scoped_release nogil;  // every rank of the group blocks here together
    nccl_check(ncclCommInitRank(&nccl, size, id, rank), "ncclCommInitRank");
  }
  std::unique_ptr<Communicator> comm;
  try {
    comm = make_nccl_communicator(nccl, reinterpret_cast<cudaStream_t>(stream));
  } catch (...) {
    ncclCommDestroy(nccl);
    throw;
  }
  // tpnorm borrows the ncclComm_t; this owner destroys it after the communicator.
  return std::shared_ptr<Communicator>(comm.release(), [nccl](Communicator* c) {
    delete c;
    ncclCommDestroy(nccl);
  });
}
#else
bool has_nccl() { return false; }
py::bytes nccl_unique_id() {
  throw Error(ErrorCode::kInvalidArgument, "tpnorm: this build has no NCCL backend");
}
std::shared_ptr<Communicator> nccl_communicator(py::bytes, int, int, int, uintptr_t) {
  throw Error(ErrorCode::kInvalidArgument, "tpnorm: this build has no NCCL backend");
}
#endif

}  // namespace tpnorm::python
