// mpi.cpp — the MPI communicator over host buffers: one all-reduce (MPI_SUM) per call on a
// duplicate of the caller's communicator, blocking (all_reduce_sum) or started now and waited
// later (start_all_reduce_sum / wait: MPI_Iallreduce).
//
// Watchdog: the all-reduce is MPI_Iallreduce completed by polling MPI_Test against a deadline,
// so a collective that a dead or stuck rank never joins ends the job with MPI_Abort and a
// message naming op, rank and call sequence, instead of blocking forever in MPI_Allreduce. No
// extra thread (MPI_THREAD_FUNNELED suffices, and MPI_Abort is called from the calling thread).
// Started sums are completed by the same loop when waited, so the watchdog covers them too.
#include "tpnorm/mpi.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "comm/mpi_check.h"
#include "common/check.h"

namespace tpnorm {
namespace {

MPI_Datatype mpi_type(DType t) {
  if (t == DType::F64) return MPI_DOUBLE;
  if (t == DType::F32) return MPI_FLOAT;
  if (t == DType::I64) return MPI_INT64_T;  // Stats::kExact's limbs
  throw Error(ErrorCode::kInvalidArgument,
              std::string("tpnorm: MPI all_reduce_sum supports fp32, fp64 and int64 buffers, not ") +
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
    // Every call checks the header first: its sum is non-blocking and hides under the partial
    // (see README "Agreement on every call").
    set_default_strict_calls(-1);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    // Sums started and never waited: complete them (the peers started them too) before the
    // communicator goes, so that no request outlives it. Errors cannot be thrown from here.
    for (Pending& p : pending_) complete(p, /*may_throw=*/false);
    MPI_Comm_free(&comm_);
  }
  [[noreturn]] void abort_job(const std::string& message) override {
    std::fprintf(stderr, "%s\n", message.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);  // the whole job, not only this group
    std::abort();                  // MPI_Abort does not return; the compiler cannot know
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cpu(); }

 protected:
  void do_all_reduce_sum(void* buf, size_t count, DType dtype) override {
    if (!(timeout() > 0)) {  // watchdog off: the blocking call, which costs less (see README)
      const MPI_Datatype type = mpi_type(dtype);
      for_each_chunk(buf, count, dtype, [&](void* at, int n) {
        TPNORM_CHECK(MPI, MPI_Allreduce(MPI_IN_PLACE, at, n, type, MPI_SUM, comm_));
      });
      return;
    }
    Pending p = start(0, buf, count, dtype);
    complete(p, true);
  }
  void do_start_all_reduce_sum(uint64_t id, void* buf, size_t count, DType dtype) override {
    pending_.push_back(start(id, buf, count, dtype));
  }
  void do_wait(uint64_t id) override {
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (pending_[i].id != id) continue;
      Pending p = std::move(pending_[i]);
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
      complete(p, true);
      return;
    }
  }

 private:
  // Same exit status as `timeout`: the job ran out of time.
  static constexpr int kWatchdogExitCode = 124;

  // One started sum: its MPI requests (one per chunk of at most 2^30 elements) and what the
  // watchdog names if it never completes.
  struct Pending {
    uint64_t id = 0;
    std::vector<MPI_Request> reqs;
    const char* op = nullptr;
    uint64_t sequence = 0;
  };

  // MPI counts are int: large buffers go in chunks (the same split on every rank).
  template <class F>
  static void for_each_chunk(void* buf, size_t count, DType dtype, F&& f) {
    constexpr size_t kChunk = size_t{1} << 30;
    char* p = static_cast<char*>(buf);
    for (size_t done = 0; done < count; done += kChunk) {
      const size_t n = count - done < kChunk ? count - done : kChunk;
      f(p + done * dtype_size(dtype), static_cast<int>(n));
    }
  }

  Pending start(uint64_t id, void* buf, size_t count, DType dtype) {
    const MPI_Datatype type = mpi_type(dtype);
    Pending p{id, {}, current_op(), sequence()};
    for_each_chunk(buf, count, dtype, [&](void* at, int n) {
      p.reqs.push_back(MPI_REQUEST_NULL);
      TPNORM_CHECK(MPI, MPI_Iallreduce(MPI_IN_PLACE, at, n, type, MPI_SUM, comm_,
                                       &p.reqs.back()));
    });
    return p;
  }

  // The one wait loop of this communicator: polls MPI_Testall (which also drives MPI's
  // progress for every other request in flight) until done, or until the watchdog's deadline
  // when it is on, then ends the job with MPI_Abort and a message naming the op that started
  // the sum, this rank and its call sequence.
  void complete(Pending& p, bool may_throw) {
    const int n = static_cast<int>(p.reqs.size());
    if (!(timeout() > 0)) {
      const int rc = MPI_Waitall(n, p.reqs.data(), MPI_STATUSES_IGNORE);
      if (may_throw) TPNORM_CHECK(MPI, rc);
      return;
    }
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + std::chrono::duration<double>(timeout());
    int done = 0;
    // Reading the clock costs ~20 ns; every 64th poll keeps it out of the latency of small calls.
    for (unsigned poll = 1;; ++poll) {
      const int rc = MPI_Testall(n, p.reqs.data(), &done, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) {
        if (may_throw) TPNORM_CHECK(MPI, rc);
        return;
      }
      if (done) return;
      if (poll % 64 == 0 && clock::now() > deadline) {
        std::fprintf(stderr, "%s\n", watchdog_message(p.op, p.sequence).c_str());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, kWatchdogExitCode);  // the whole job, not only this group
      }
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::vector<Pending> pending_;  // started, not yet waited, in start order
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm) {
  return std::make_unique<MpiCommunicator>(comm);
}

}  // namespace tpnorm
