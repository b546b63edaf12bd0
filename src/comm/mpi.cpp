// mpi.cpp — the MPI communicator over host buffers: one MPI_Allreduce(MPI_SUM) per call on a
// duplicate of the caller's communicator.
#include "tpnorm/mpi.h"

#include <string>

#include "common/check.h"

namespace tpnorm::detail {

inline bool MPI_ok(int rc) { return rc == MPI_SUCCESS; }
inline std::string MPI_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(buf, len);
}

}  // namespace tpnorm::detail

namespace tpnorm {
namespace {

MPI_Datatype mpi_type(DType t) {
  if (t == DType::F64) return MPI_DOUBLE;
  if (t == DType::F32) return MPI_FLOAT;
  throw Error(ErrorCode::kInvalidArgument,
              std::string("tpnorm: MPI all_reduce_sum supports fp32 and fp64 buffers, not ") +
                  dtype_name(t));
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm parent) {
    TPNORM_CHECK(MPI, MPI_Comm_dup(parent, &comm_));
    // Errors come back as return codes (and become tpnorm::Error) instead of aborting.
    TPNORM_CHECK(MPI, MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    TPNORM_CHECK(MPI, MPI_Comm_rank(comm_, &rank_));
    TPNORM_CHECK(MPI, MPI_Comm_size(comm_, &size_));
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cpu(); }

 protected:
  void do_all_reduce_sum(void* buf, size_t count, DType dtype) override {
    const MPI_Datatype type = mpi_type(dtype);
    // MPI counts are int: large buffers go in chunks (same split on every rank).
    constexpr size_t kChunk = size_t{1} << 30;
    char* p = static_cast<char*>(buf);
    for (size_t done = 0; done < count; done += kChunk) {
      const size_t n = count - done < kChunk ? count - done : kChunk;
      TPNORM_CHECK(MPI, MPI_Allreduce(MPI_IN_PLACE, p + done * dtype_size(dtype),
                                      static_cast<int>(n), type, MPI_SUM, comm_));
    }
  }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm) {
  return std::make_unique<MpiCommunicator>(comm);
}

}  // namespace tpnorm
