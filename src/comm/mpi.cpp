// mpi.cpp — the MPI communicator over host buffers: one all-reduce (MPI_SUM) per call on a
// duplicate of the caller's communicator, blocking (all_reduce_sum) or started now and waited
// later (start_all_reduce_sum / wait: MPI_Iallreduce).
//
// Watchdog: the all-reduce is MPI_Iallreduce completed by polling MPI_Test against a deadline,
// so a collective that a dead or stuck rank never joins ends the job with MPI_Abort and a
// message naming op, rank and call sequence, instead of blocking forever in MPI_Allreduce. No
// extra thread (MPI_THREAD_FUNNELED suffices, and MPI_Abort is called from the calling thread).
// Started sums are completed by the same loop when waited, so the watchdog covers them too.
// Small sums are an exchange of point-to-point messages instead (see kExchangeBytes).
#include "tpnorm/mpi.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "comm/mpi_check.h"
#include "comm/mpi_util.h"
#include "common/check.h"

namespace tpnorm {
namespace {

using detail::mpi_type;

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm parent) {
    detail::dup_comm(parent, &comm_, &rank_, &size_);
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
    for (Retired& r : retired_)
      MPI_Waitall(static_cast<int>(r.reqs.size()), r.reqs.data(), MPI_STATUSES_IGNORE);
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

  // One started sum: its MPI requests (one per chunk of at most 2^30 elements, or the
  // exchange's receives then sends) and what the watchdog names if it never completes.
  struct Pending {
    uint64_t id = 0;
    std::vector<MPI_Request> reqs;
    const char* op = nullptr;
    uint64_t sequence = 0;
    // The exchange (see start): the sum's buffer and the other ranks' contributions.
    bool exchange = false;
    int pieces = 0;            // messages per peer
    int receives = 0;          // reqs[0, receives) are receives, the rest sends
    std::vector<double> send;  // the copy the sends read
    void* buf = nullptr;
    int count = 0;
    DType dtype = DType::F64;
    std::vector<double> recv;  // (P - 1) contributions, 8-byte aligned for either type
  };

  // Small sums go as an exchange instead of MPI_Iallreduce: every rank sends its buffer to
  // every other rank when the sum starts, and adds the P contributions in rank order when it
  // is waited (the same additions in the same order on every rank, so every rank gets the
  // same bits). Open MPI's non-blocking all-reduce advances only inside MPI calls, so its
  // later rounds (a reduce to a root, then a broadcast, for small sums) wait for the wait
  // call: work done between start and wait hides one round at most. The exchange has one
  // round, posted at start, so the wait finds the contributions there (messages up to the
  // shared-memory eager size, 4 KiB by default, need nothing of the receiver to be
  // delivered). Bytes per rank: (P - 1) x the buffer, hence the limit.
  static constexpr size_t kExchangeBytes = size_t{64} << 10;
  static constexpr int kExchangeTag = 7401;
  static constexpr size_t kPieceBytes = 2048;

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
    Pending p;
    p.id = id;
    p.op = current_op();
    p.sequence = sequence();
    const size_t bytes = count * dtype_size(dtype);
    if (size_ > 1 && bytes * static_cast<size_t>(size_ - 1) <= kExchangeBytes) {
      p.exchange = true;
      p.buf = buf;
      p.count = static_cast<int>(count);
      p.dtype = dtype;
      p.recv.resize((bytes * static_cast<size_t>(size_ - 1) + 7) / 8);
      char* slots = reinterpret_cast<char*>(p.recv.data());
      // In pieces of at most kPieceBytes, each below the shared-memory eager size: a send
      // then completes at once, without the receiver, so a rank's wait never waits for a
      // slower peer to reach its own wait (only for its data, sent when it started the sum).
      const int per_piece = static_cast<int>(kPieceBytes / dtype_size(dtype));
      const int pieces = (p.count + per_piece - 1) / per_piece;
      p.pieces = pieces;
      p.reqs.assign(static_cast<size_t>(2 * (size_ - 1) * pieces), MPI_REQUEST_NULL);
      size_t r = 0;
      for (int q = 0, k = 0; q < size_; ++q) {  // receives first (in rank order), then sends
        if (q == rank_) continue;
        char* slot = slots + static_cast<size_t>(k++) * bytes;
        for (int i = 0; i < pieces; ++i) {
          const int n = std::min(per_piece, p.count - i * per_piece);
          TPNORM_CHECK(MPI, MPI_Irecv(slot + static_cast<size_t>(i) * kPieceBytes, n, type, q,
                                      kExchangeTag, comm_, &p.reqs[r++]));
        }
      }
      // Sent from a copy, so that the wait needs only the receives: a send completes when the
      // peer has taken the data, which may be after this rank's wait (the copy lives on in
      // retired_ until then).
      p.send.assign(p.recv.size() / static_cast<size_t>(size_ - 1) + 1, 0.0);
      std::memcpy(p.send.data(), buf, bytes);
      const char* send = reinterpret_cast<const char*>(p.send.data());
      p.receives = static_cast<int>(r);
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        for (int i = 0; i < pieces; ++i) {
          const int n = std::min(per_piece, p.count - i * per_piece);
          TPNORM_CHECK(MPI, MPI_Isend(send + static_cast<size_t>(i) * kPieceBytes, n, type, q,
                                      kExchangeTag, comm_, &p.reqs[r++]));
        }
      }
      return p;
    }
    for_each_chunk(buf, count, dtype, [&](void* at, int n) {
      p.reqs.push_back(MPI_REQUEST_NULL);
      TPNORM_CHECK(MPI, MPI_Iallreduce(MPI_IN_PLACE, at, n, type, MPI_SUM, comm_, &p.reqs.back()));
    });
    return p;
  }

  // The one wait loop of this communicator: polls MPI_Testall (which also drives MPI's
  // progress for every other request in flight) until done, or until the watchdog's deadline
  // when it is on, then ends the job with MPI_Abort and a message naming the op that started
  // the sum, this rank and its call sequence.
  void complete(Pending& p, bool may_throw) {
    retire_sends(p);
    const int n = static_cast<int>(p.reqs.size());
    std::vector<MPI_Status> status(p.exchange ? p.reqs.size() : 0);
    MPI_Status* st = p.exchange ? status.data() : MPI_STATUSES_IGNORE;
    if (!(timeout() > 0)) {
      const int rc = MPI_Waitall(n, p.reqs.data(), st);
      if (may_throw) TPNORM_CHECK(MPI, rc);
      if (rc == MPI_SUCCESS && p.exchange) add_exchange(p, status, may_throw);
      return;
    }
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + std::chrono::duration<double>(timeout());
    int done = 0;
    // Reading the clock costs ~20 ns; every 64th poll keeps it out of the latency of small calls.
    for (unsigned poll = 1;; ++poll) {
      const int rc = MPI_Testall(n, p.reqs.data(), &done, st);
      if (rc != MPI_SUCCESS) {
        if (may_throw) TPNORM_CHECK(MPI, rc);
        return;
      }
      if (done) {
        if (p.exchange) add_exchange(p, status, may_throw);
        return;
      }
      if (poll % 64 == 0 && clock::now() > deadline) {
        std::fprintf(stderr, "%s\n", watchdog_message(p.op, p.sequence).c_str());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, kWatchdogExitCode);  // the whole job, not only this group
      }
    }
  }

  // The exchange's sum: contributions of ranks 0..P-1 added in that order into p.buf. A
  // contribution of another length (ranks that disagree on a size, past the strict calls) is
  // an error here, not a sum of what happened to arrive.
  void add_exchange(Pending& p, const std::vector<MPI_Status>& status, bool may_throw) {
    const MPI_Datatype type = mpi_type(p.dtype);
    const int per_piece = static_cast<int>(kPieceBytes / dtype_size(p.dtype));
    for (int k = 0; k < (size_ - 1) * p.pieces; ++k) {
      const int i = k % p.pieces, want = std::min(per_piece, p.count - i * per_piece);
      int got = 0;
      MPI_Get_count(&status[k], type, &got);
      if (got != want) {
        if (!may_throw) return;
        throw Error(ErrorCode::kCommunication,
                    "tpnorm: all_reduce_sum: rank " + std::to_string(rank_) + " expected " +
                        std::to_string(want) + " values from rank " +
                        std::to_string(status[k].MPI_SOURCE) + ", got " + std::to_string(got) +
                        " (the ranks disagree on the size of a collective)");
      }
    }
    switch (p.dtype) {
      case DType::F64:
        return add_in_rank_order(static_cast<double*>(p.buf),
                                 reinterpret_cast<const double*>(p.recv.data()), p.count);
      case DType::I64:
        return add_in_rank_order(static_cast<int64_t*>(p.buf),
                                 reinterpret_cast<const int64_t*>(p.recv.data()), p.count);
      default:  // F32 (mpi_type refused the rest at start)
        return add_in_rank_order(static_cast<float*>(p.buf),
                                 reinterpret_cast<const float*>(p.recv.data()), p.count);
    }
  }
  template <class T>
  void add_in_rank_order(T* mine, const T* others, int n) const {
    // others holds ranks 0..P-1 without this one, in order: slot k is rank k + (k >= rank_).
    for (int i = 0; i < n; ++i) {
      T acc = rank_ == 0 ? mine[i] : others[i];
      for (int r = 1; r < size_; ++r) {
        const T v = r == rank_ ? mine[i] : others[static_cast<size_t>(r - (r > rank_)) * n + i];
        acc += v;
      }
      mine[i] = acc;
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::vector<Pending> pending_;  // started, not yet waited, in start order

  // Exchange sends still in flight after their sum was waited, with the copy they read.
  struct Retired {
    std::vector<MPI_Request> reqs;
    std::vector<double> send;
  };
  std::vector<Retired> retired_;
  // Moves an exchange's sends out of p (its wait then needs its receives only), and drops
  // the retired sends that have completed since.
  void retire_sends(Pending& p) {
    for (size_t i = 0; i < retired_.size();) {
      int done = 0;
      MPI_Testall(static_cast<int>(retired_[i].reqs.size()), retired_[i].reqs.data(), &done,
                  MPI_STATUSES_IGNORE);
      if (done) {
        retired_[i] = std::move(retired_.back());
        retired_.pop_back();
      } else {
        ++i;
      }
    }
    if (!p.exchange || p.send.empty()) return;
    Retired r;
    r.reqs.assign(p.reqs.begin() + p.receives, p.reqs.end());
    r.send = std::move(p.send);
    p.reqs.resize(static_cast<size_t>(p.receives));
    retired_.push_back(std::move(r));
  }
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm) {
  return std::make_unique<MpiCommunicator>(comm);
}

}  // namespace tpnorm
