// Host tests (no GPU needed) of the device communicators' policies: the workspace pool
// (comm/cuda/workspace.h: a region per call in flight; never free a block a captured graph may
// replay into) and the NCCL
// communicator's watchdog (comm/cuda/watchdog.h: tickets in stream order, a deadline, the
// transport's asynchronous error), each driven by the test's own allocator and probes.
#include <gtest/gtest.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "comm/cuda/watchdog.h"
#include "comm/cuda/workspace.h"
#include "comm/device_comm.h"
#include "common/call_header.h"
#include "common/exact_sum.h"

using tpnorm::detail::Watchdog;
using tpnorm::detail::Workspace;

namespace {

// malloc-backed blocks, tracking which are alive.
struct Heap {
  std::set<void*> live;
  int allocs = 0;
  bool fail_next = false;
  Workspace make() {
    return Workspace(
        [this](size_t n) {
          if (fail_next) throw tpnorm::Error(tpnorm::ErrorCode::kCommunication, "out of memory");
          void* p = std::malloc(n);
          std::memset(p, 0, n);
          live.insert(p);
          ++allocs;
          return p;
        },
        [this](void* p) {
          live.erase(p);
          std::free(p);
        });
  }
};

// Each call in flight owns its region: q and k started before either finishes never share one.
TEST(GpuWorkspacePool, TwoCallsInFlightGetDistinctRegionsFinishedInAnyOrder) {
  Heap heap;
  Workspace ws = heap.make();
  void* q = ws.acquire(1000, false);
  void* k = ws.acquire(1000, false);
  EXPECT_NE(q, k) << "two calls in flight share one workspace region";
  EXPECT_EQ(ws.busy(), 2u);
  ws.release(q);  // q finishes first
  void* next = ws.acquire(1000, false);
  EXPECT_EQ(next, q) << "a finished call's region is reused";
  EXPECT_NE(next, k) << "k is still in flight";
  ws.release(k);
  ws.release(next);
  EXPECT_EQ(ws.busy(), 0u);
  EXPECT_EQ(heap.allocs, 2) << "two in flight at most: two regions";
}

TEST(GpuWorkspacePool, ThreeCallsInFlightEveryReleaseOrder) {
  const int orders[6][3] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
  for (const auto& order : orders) {
    Heap heap;
    Workspace ws = heap.make();
    void* r[3];
    for (int i = 0; i < 3; ++i) {
      r[i] = ws.acquire(100 + 1000 * i, false);
      std::memset(r[i], 'a' + i, 100 + 1000 * i);  // each call writes its own region
    }
    EXPECT_TRUE(r[0] != r[1] && r[1] != r[2] && r[0] != r[2]);
    for (int j = 0; j < 3; ++j) {
      const int i = order[j];
      // Nothing another call did touched this call's bytes.
      const char* c = static_cast<const char*>(r[i]);
      for (int b = 0; b < 100 + 1000 * i; ++b) ASSERT_EQ(c[b], 'a' + i) << "region " << i;
      ws.release(r[i]);
      // A call started now gets a region no call still in flight holds.
      void* fresh = ws.acquire(50, false);
      for (int m = j + 1; m < 3; ++m) EXPECT_NE(fresh, r[order[m]]);
      ws.release(fresh);
    }
    EXPECT_EQ(ws.busy(), 0u);
    EXPECT_EQ(heap.allocs, 3);
  }
}

// Growth: a larger call gets a larger block; the free blocks it supersedes are retired (kept
// alive: earlier work on the stream may still use them), never handed out again nor freed.
TEST(GpuWorkspacePool, GrowthRetiresSmallerFreeBlocksAndFreesOnlyAtDestruction) {
  Heap heap;
  {
    Workspace ws = heap.make();
    void* a = ws.acquire(100, false);
    EXPECT_EQ(ws.capacity_at(a), Workspace::kMinBytes);
    ws.release(a);
    EXPECT_EQ(ws.acquire(Workspace::kMinBytes, false), a) << "no growth within the capacity";
    ws.release(a);
    void* b = ws.acquire(Workspace::kMinBytes + 1, false);
    EXPECT_NE(b, a);
    EXPECT_EQ(ws.capacity_at(b), 2 * Workspace::kMinBytes) << "doubling";
    EXPECT_TRUE(heap.live.count(a)) << "a block earlier work may use was freed";
    ws.release(b);
    EXPECT_EQ(ws.acquire(10, false), b) << "the retired block is not handed out again";
    void* c = ws.acquire(size_t{1} << 20, false);  // b in flight: c is a new block
    EXPECT_EQ(ws.capacity_at(c), size_t{1} << 20);
    EXPECT_TRUE(heap.live.count(a) && heap.live.count(b) && heap.live.count(c));
    EXPECT_EQ(ws.blocks(), 3u);
    EXPECT_EQ(heap.allocs, 3);
  }
  EXPECT_TRUE(heap.live.empty()) << "the destructor frees every block";
}

// Capture: no allocation; a captured call takes a free region and keeps it for captured calls
// only (a graph replays into it between eager calls); an eager call never gets it again.
TEST(GpuWorkspacePool, CapturedRegionsAreNeverHandedToEagerCalls) {
  Heap heap;
  Workspace ws = heap.make();
  void* warm = ws.acquire(1000, false);  // the call run once before capturing it
  ws.release(warm);
  void* cap = ws.acquire(1000, true);
  EXPECT_EQ(cap, warm) << "capture takes the free region the warm-up left";
  ws.release(cap);  // the captured call's finish (still inside the capture)
  void* cap2 = ws.acquire(500, true);
  EXPECT_EQ(cap2, cap) << "a later captured call reuses the captured region";
  ws.release(cap2);
  // After the capture: an eager call started, a replay, its finish. It must not use `cap`.
  void* eager = ws.acquire(1000, false);
  EXPECT_NE(eager, cap) << "an eager call got the region a graph replays into";
  ws.release(eager);
  EXPECT_EQ(heap.allocs, 2);
}

TEST(GpuWorkspacePool, CaptureNeverAllocatesAndFailuresChangeNothing) {
  Heap heap;
  Workspace ws = heap.make();
  void* a = ws.acquire(10, false);
  ws.release(a);
  void* c1 = ws.acquire(1000, true);
  EXPECT_EQ(c1, a);
  // A second call in flight inside the capture: nothing is free, and capture cannot allocate.
  try {
    ws.acquire(1000, true);
    ADD_FAILURE() << "allocated during capture";
  } catch (const tpnorm::Error& e) {
    EXPECT_EQ(e.code(), tpnorm::ErrorCode::kInvalidArgument);
    EXPECT_NE(std::strstr(e.what(), "captured"), nullptr) << e.what();
  }
  EXPECT_EQ(heap.allocs, 1);
  ws.release(c1);
  // A reserve before the capture leaves the second region the capture needs.
  ws.reserve(1000);
  void* d1 = ws.acquire(1000, true);
  void* d2 = ws.acquire(1000, true);
  EXPECT_NE(d1, d2);
  ws.release(d1);
  ws.release(d2);
  // A failed allocation changes nothing.
  heap.fail_next = true;
  const size_t blocks = ws.blocks();
  EXPECT_THROW(ws.acquire(size_t{1} << 20, false), tpnorm::Error);
  EXPECT_EQ(ws.blocks(), blocks);
  EXPECT_EQ(ws.busy(), 0u);
}

TEST(GpuWorkspacePool, FitsAndOwnsDescribeTheBlockHoldingAPointer) {
  Heap heap;
  Workspace ws = heap.make();
  EXPECT_FALSE(ws.owns(&heap));
  char* a = static_cast<char*>(ws.acquire(10, false));
  char* b = static_cast<char*>(ws.acquire(10, false));
  const size_t cap = ws.capacity_at(a);
  EXPECT_TRUE(ws.owns(a) && ws.owns(a + cap - 1) && ws.owns(b));
  EXPECT_TRUE(ws.fits(a, cap));
  EXPECT_TRUE(ws.fits(a + 256, cap - 256));
  EXPECT_FALSE(ws.fits(a + 256, cap - 255)) << "a collective longer than the block";
  EXPECT_TRUE(ws.fits(b, ws.capacity_at(b)));
}

// The int64 poison of a header whose write failed (Stats::kExact): the summed failure flag and
// count of any mix of poisoned, failed and good ranks are rejected by the exact header check
// (flag != 0, count outside [0, 2^32)) and never overflow. The all-ones bytes of the float
// wires would be -1 here, which one failed rank's +1 cancels.
TEST(GpuPoison, Int64PoisonIsNeverCancelledNorOverflows) {
  const int64_t poison = tpnorm::detail::kInt64Poison;
  unsigned char bytes[8] = {};
  bytes[tpnorm::detail::kInt64PoisonByte] = 1;  // what cudaMemset2DAsync writes per word
  int64_t word = 0;
  std::memcpy(&word, bytes, 8);
  EXPECT_EQ(word, poison);
  const int64_t max_p = tpnorm::exact::kMaxRanks;
  for (int64_t p : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{17}, max_p})
    for (int64_t k = 1; k <= p; k = k < 4 ? k + 1 : k * 2) {
      for (int64_t f : {int64_t{0}, int64_t{1}, p - k}) {
        if (f < 0 || f > p - k) continue;
        // The flag: k poisoned words plus f failed ranks' 1; the count: k poisoned words plus
        // the others' counts (each below 2^32).
        const __int128 flag = static_cast<__int128>(k) * poison + f;
        const __int128 count = static_cast<__int128>(k) * poison;
        EXPECT_NE(flag, 0) << "p " << p << " k " << k << " f " << f;
        EXPECT_LT(flag, static_cast<__int128>(INT64_MAX));
        EXPECT_GE(count, static_cast<__int128>(1) << 32);
        EXPECT_LT(count + static_cast<__int128>(p) * ((int64_t{1} << 32) - 1),
                  static_cast<__int128>(INT64_MAX));
      }
    }
  int64_t all_ones = 0;
  std::memset(&all_ones, 0xff, 8);
  EXPECT_EQ(all_ones + 1, 0) << "the cancellation the int64 poison avoids";
}

// The watchdog with scripted probes; fire() records instead of ending the process.
struct Script {
  std::mutex mu;
  std::set<uint64_t> done;    // tickets whose collective has finished
  std::set<uint64_t> failed;  // tickets whose event reports an error
  std::vector<uint64_t> released;
  std::string async;  // the transport's asynchronous error
  std::string fired;
  std::atomic<int> fires{0};
  Watchdog::Hooks hooks() {
    Watchdog::Hooks h;
    h.probe = [this](uint64_t t, std::string* why) {
      std::lock_guard<std::mutex> g(mu);
      if (failed.count(t)) {
        *why = "an illegal address";
        return Watchdog::State::kFailed;
      }
      return done.count(t) ? Watchdog::State::kDone : Watchdog::State::kPending;
    };
    h.release = [this](uint64_t t) {
      std::lock_guard<std::mutex> g(mu);
      released.push_back(t);
    };
    h.async_error = [this] {
      std::lock_guard<std::mutex> g(mu);
      return async;
    };
    h.describe = [](const char* what, uint64_t seq) {
      return std::string("tpnorm watchdog: ") + what + " (call " + std::to_string(seq) + ")";
    };
    h.fire = [this](const std::string& m) {
      std::lock_guard<std::mutex> g(mu);
      fired = m;
      ++fires;
    };
    return h;
  }
  void finish(uint64_t t) {
    std::lock_guard<std::mutex> g(mu);
    done.insert(t);
  }
  size_t released_count() {
    std::lock_guard<std::mutex> g(mu);
    return released.size();
  }
};

// Waits (at most a minute: a liveness bound, not a timing claim) for pred().
template <class P>
bool eventually(P pred) {
  for (int i = 0; i < 60000; ++i) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return pred();
}

TEST(GpuWatchdog, OverdueTicketFiresWithItsMessage) {
  Script s;
  Watchdog w(s.hooks());
  w.watch(7, 0.01, "layer_norm_forward", 20);
  ASSERT_TRUE(eventually([&] { return s.fires.load() > 0; }));
  EXPECT_EQ(s.fires.load(), 1) << "fires once";
  EXPECT_NE(s.fired.find("layer_norm_forward (call 20)"), std::string::npos) << s.fired;
  EXPECT_TRUE(w.fired());
}

TEST(GpuWatchdog, FinishedTicketsAreReleasedInStreamOrderAndNothingFires) {
  Script s;
  {
    Watchdog w(s.hooks());
    w.watch(1, 600, "first", 1);
    w.watch(2, 600, "second", 2);
    s.finish(2);  // the later event cannot be retired before the earlier one
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_EQ(s.released_count(), 0u);
    s.finish(1);
    ASSERT_TRUE(eventually([&] { return s.released_count() == 2; }));
    EXPECT_EQ(s.released[0], 1u);
    EXPECT_EQ(s.released[1], 2u);
    EXPECT_EQ(w.pending(), 0u);
    w.watch(3, 600, "pending when the communicator goes", 3);
  }  // the destructor stops the thread with a ticket still pending: no fire
  EXPECT_EQ(s.fires.load(), 0);
}

TEST(GpuWatchdog, AsyncTransportErrorFiresEvenWithNothingPending) {
  Script s;
  Watchdog w(s.hooks(), std::chrono::milliseconds(1), std::chrono::milliseconds(5));
  {
    std::lock_guard<std::mutex> g(s.mu);
    s.async = "tpnorm watchdog: rank 0 of 2: NCCL reported an asynchronous error: remote";
  }
  ASSERT_TRUE(eventually([&] { return s.fires.load() > 0; }));
  EXPECT_NE(s.fired.find("asynchronous error"), std::string::npos) << s.fired;
}

TEST(GpuWatchdog, FailedEventFiresWithTheReason) {
  Script s;
  {
    std::lock_guard<std::mutex> g(s.mu);
    s.failed.insert(4);
  }
  Watchdog w(s.hooks());
  w.watch(4, 600, "rms_norm_backward", 9);
  ASSERT_TRUE(eventually([&] { return s.fires.load() > 0; }));
  EXPECT_NE(s.fired.find("rms_norm_backward (call 9) (an illegal address)"), std::string::npos)
      << s.fired;
}

}  // namespace
