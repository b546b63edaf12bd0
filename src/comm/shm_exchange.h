// shm_exchange.h — the MPI communicator's small sums through MPI-3 shared memory, when every
// rank of the communicator is on one node.
//
// Why: the point-to-point exchange (comm/mpi.cpp) sends every contribution when a sum starts,
// but Open MPI takes the fragments out of its shared-memory queues, matches and copies them
// only inside MPI calls on the RECEIVER, i.e. in the wait: a split-phase call's finish() paid
// about the whole exchange however much work ran between start and finish. Here the
// contributions are plain memory the receiver reads when it waits; nothing has to be progressed.
//
// The window (MPI_Win_allocate_shared, once per communicator): each rank owns a ring of kSlots
// slots; a slot is [seq | count] on one cache line, [reads] on the next, then the data.
// - start of sum n (the communicator's n-th sum, the same n on every rank): the rank writes
//   its count and values into its slot n % kSlots and publishes them with a release store
//   seq = n + 1. If the slot held an earlier sum, the rank first waits until each peer has read
//   that one (reads, incremented by every reader after its last load).
// - finish: acquire each peer's seq (spinning), check every count (ranks that disagree all see
//   the same counts, so they all throw the same kMismatch), add the P contributions in rank
//   order (the same additions on every rank: the same bits), then count the reads.
// No deadlock when every rank has kSlots sums started and none waited: before its slot wait,
// start(n) completes the rank's OWN copy of the slot's earlier sum (reads the peers'
// contributions, which they published before starting anything later), so every peer that
// reaches start(n), and every peer that waits that sum or destroys the communicator, reads
// this rank's slot: the writer
// waits only for reads that will happen. The result (or the error) of a sum completed that way
// is kept until its wait.
//
// Progress in the background (split-phase calls): after a call's start, the sums it left in
// flight are handed to a progress thread (made on first use, one per exchange), which adds
// each as soon as every peer has published it, while the caller computes. The wait then only
// sees that the sum is done: it costs nothing, and the add runs while the contributions are
// still in cache instead of after the caller's own work evicted them. The thread never calls
// MPI and never blocks a peer: a sum is added by whichever of the thread and the waiting
// caller claims it first (one compare-exchange), the other waits for it or drops it; the
// thread polls the sums it holds (any order: none blocks another) and sleeps between polls
// with a growing pause (10 us .. 200 us), so a slow peer costs little CPU. Blocking calls never
// hand their sums over (their wait follows at once): they pay no wake-up.
//
// Completion words: whoever adds sum n without an error (thread or caller) also stores n + 1,
// with release, into word n % kSlots of an array the owner passes in (set_completion_words),
// BEFORE it marks the record done. A word is only ever raised to a later sum's n + 1 (sum
// n + kSlots starts after its slot's earlier sum n is done), so reading n + 1 there (acquire)
// means: sum n is in the buffer, without error. The owner keeps the words where its wait
// already looks (comm/mpi.cpp: in the communicator itself), so that a wait after long work
// finds a sum done by touching nothing else (each cold page costs about a microsecond).
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tpnorm/error.h"
#include "tpnorm/tensor.h"

namespace tpnorm::detail {

class ShmExchange {
 public:
  /// Slots per rank: sums that can be in flight before a start completes the oldest one itself.
  static constexpr uint64_t kSlots = 16;

  /// TPNORM_SHM: unset or anything but "0" = use shared memory where the ranks share a node.
  static bool enabled_by_env();

  /// Collective over `comm` (rank `rank` of `size`): the exchange if `want` holds on every
  /// rank, size >= 2 and every rank of `comm` is on this node (MPI_COMM_TYPE_SHARED spans it);
  /// else nullptr, on every rank alike. `max_bytes`: the largest contribution of one rank.
  static std::unique_ptr<ShmExchange> create(MPI_Comm comm, int rank, int size, size_t max_bytes,
                                             bool want);
  ~ShmExchange();  // collective: stops the progress thread, frees the window (after every
                   // sum was completed)
  ShmExchange(const ShmExchange&) = delete;
  ShmExchange& operator=(const ShmExchange&) = delete;

  /// Called every few dozen polls while a rank waits for its peers: drives MPI's progress (a
  /// peer may be waiting for this rank's part of an MPI_Iallreduce) and checks the watchdog.
  /// (An interface, not std::function: nothing is allocated on the path of a small sum.)
  struct Idle {
    virtual void operator()() = 0;

   protected:
    ~Idle() = default;
  };

  /// Starts sum n: copies `count` elements of `dtype` at `buf` (at most max_bytes) into this
  /// rank's slot n % kSlots and publishes them. n numbers EVERY sum of the communicator (large
  /// ones too, which leave their slot unused), so ranks that disagree on which sums are small
  /// never pair different sums: they wait for a seq that never comes, until the watchdog. `buf`
  /// receives the sum at finish(n) (or earlier, see above) and must stay untouched until then.
  void start(uint64_t n, void* buf, int count, DType dtype, Idle& idle);
  /// Completes sum n: `buf` holds the sum. Throws kMismatch (the ranks passed different counts:
  /// the same text on every rank) or kCommunication (a peer's slot is not this protocol's).
  /// With may_throw false (a communicator going away) errors are dropped.
  void finish(uint64_t n, Idle& idle, bool may_throw);

  /// Where to store the completion words (see the top): kSlots words that outlive this
  /// exchange, or nullptr (none). Call before the first start.
  void set_completion_words(std::atomic<uint64_t>* words) { done_words_ = words; }

  /// Hands every sum started and not yet completed to the progress thread (see the top).
  /// If the thread cannot be made, the waits add the sums as before.
  void progress_in_background();

  /// Sums started through this exchange (for tests: the path actually taken).
  uint64_t sums() const { return sums_; }
  /// Sums the progress thread added (for tests: the background path actually taken).
  uint64_t background_sums() const { return background_sums_.load(std::memory_order_relaxed); }

 private:
  ShmExchange(MPI_Comm comm, int rank, int size, size_t max_bytes);

  // The shared layout. std::atomic<uint64_t> in memory mapped by several processes: it must
  // be lock-free (hence address-free), the only kind the C++ standard says works there.
  static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory counters need it");
  struct alignas(64) Head {
    std::atomic<uint64_t> seq;    // n + 1 of the sum the slot holds (release by the owner)
    std::atomic<uint64_t> count;  // its owner's count (relaxed; ordered by seq)
  };
  struct alignas(64) Reads {
    std::atomic<uint64_t> reads;  // peers' reads of this slot, over all its uses (release)
  };
  static constexpr size_t kDataOffset = sizeof(Head) + sizeof(Reads);

  char* slot(int rank, uint64_t n) const {
    return bases_[static_cast<size_t>(rank)] + (n % kSlots) * stride_;
  }
  Head& head(int rank, uint64_t n) const { return *reinterpret_cast<Head*>(slot(rank, n)); }
  Reads& reads(int rank, uint64_t n) const {
    return *reinterpret_cast<Reads*>(slot(rank, n) + sizeof(Head));
  }

  // A started sum of this rank, until its finish. Shared with the progress thread once handed
  // over; `state` says who adds it: kOpen -> kClaimed (by the thread or the caller, one
  // compare-exchange) -> kDone (release: buf, code and error are written).
  enum State : int { kOpen, kClaimed, kDone };
  struct Sum {
    uint64_t n = 0;
    void* buf = nullptr;
    int count = 0;
    DType dtype = DType::F64;
    std::atomic<int> state{kOpen};
    bool handed = false;  // given to the progress thread (the caller's thread only)
    // Between the hand-over and the thread's last access (release): a record is reused only
    // when this is false. (An atomic of its own rather than the shared_ptr's use count and a
    // fence, which ThreadSanitizer cannot follow.)
    std::atomic<bool> with_thread{false};
    ErrorCode code = ErrorCode::kMismatch;
    std::string error;  // set when collected with an error; thrown by finish
  };
  // Sum n in sums_in_flight_ (end(): completed, or never started here).
  std::vector<std::shared_ptr<Sum>>::iterator find(uint64_t n);
  // A record for a new sum: a finished one no longer held by the progress thread, or new.
  std::shared_ptr<Sum> fresh_sum();
  static constexpr size_t kSpares = 4;
  // Per slot of this rank's ring: how often it was written, and the last sum written there.
  uint64_t uses_[kSlots] = {};
  uint64_t last_[kSlots] = {};
  // The caller's thread: s is done when this returns (added here, or by the progress thread).
  void collect(Sum& s, Idle& idle);
  // Whether every peer has published sum n (or a later one: then reduce reports it).
  bool peers_ready(uint64_t n) const;
  // With every peer published: checks the counts, adds in rank order into s.buf (or records
  // the error), counts its reads of every peer's slot, then marks s done. `counts`: scratch.
  void reduce(Sum& s, std::vector<int>& counts);
  template <class Ready>
  void spin(Ready ready, Idle& idle);
  template <class T>
  void add_in_rank_order(T* out, uint64_t n, int count) const;
  // The progress thread's loop (see the top).
  void work();

  MPI_Win win_ = MPI_WIN_NULL;
  int rank_ = 0, size_ = 1;
  size_t max_bytes_ = 0, stride_ = 0;
  std::vector<char*> bases_;  // every rank's ring, as mapped in this process
  std::vector<std::shared_ptr<Sum>> sums_in_flight_;  // in start order
  std::vector<std::shared_ptr<Sum>> spare_;           // finished records, for later sums
  std::vector<int> counts_;  // the caller's scratch for reduce: every rank's count
  std::atomic<uint64_t>* done_words_ = nullptr;  // the completion words, or none
  uint64_t sums_ = 0;
  std::atomic<uint64_t> background_sums_{0};

  // The progress thread and what it is handed (queue_ and stop_ under mu_).
  std::thread worker_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Sum>> queue_;
  bool stop_ = false;
  // Tests only (TPNORM_SHM_TEST_ADD_DELAY_US, read when the exchange is made): the thread's
  // pause between claiming a sum and adding it, so that waits find sums it is still adding.
  int test_add_delay_us_ = 0;
};

/// The kMismatch text of a sum whose ranks passed different counts (`counts` by rank): the
/// same on every rank, whichever path the sum took.
std::string count_mismatch_message(const std::vector<int>& counts);

}  // namespace tpnorm::detail
