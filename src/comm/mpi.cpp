// mpi.cpp — the MPI communicator over host buffers: one all-reduce (MPI_SUM) per call on a
// duplicate of the caller's communicator.
//
// Watchdog: the all-reduce is MPI_Iallreduce completed by polling MPI_Test against a deadline,
// so a collective that a dead or stuck rank never joins ends the job with MPI_Abort and a
// message naming op, rank and call sequence, instead of blocking forever in MPI_Allreduce. No
// extra thread (MPI_THREAD_FUNNELED suffices, and MPI_Abort is called from the calling thread).
#include "tpnorm/mpi.h"

#include <chrono>
#include <cstdio>
#include <string>

#include "comm/mpi_check.h"
#include "common/check.h"

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
      void* at = p + done * dtype_size(dtype);
      if (!(timeout() > 0)) {  // watchdog off: the blocking call, which costs less (see README)
        TPNORM_CHECK(MPI, MPI_Allreduce(MPI_IN_PLACE, at, static_cast<int>(n), type, MPI_SUM,
                                        comm_));
        continue;
      }
      MPI_Request req;
      TPNORM_CHECK(MPI, MPI_Iallreduce(MPI_IN_PLACE, at, static_cast<int>(n), type, MPI_SUM,
                                       comm_, &req));
      wait(req);
    }
  }

 private:
  // Same exit status as `timeout`: the job ran out of time.
  static constexpr int kWatchdogExitCode = 124;

  void wait(MPI_Request& req) {
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + std::chrono::duration<double>(timeout());
    int done = 0;
    // Reading the clock costs ~20 ns; every 64th poll keeps it out of the latency of small calls.
    for (unsigned poll = 1;; ++poll) {
      TPNORM_CHECK(MPI, MPI_Test(&req, &done, MPI_STATUS_IGNORE));
      if (done) return;
      if (poll % 64 == 0 && clock::now() > deadline) {
        std::fprintf(stderr, "%s\n", watchdog_message().c_str());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, kWatchdogExitCode);  // the whole job, not only this group
      }
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm) {
  return std::make_unique<MpiCommunicator>(comm);
}

}  // namespace tpnorm
