// Host tests (no GPU needed) of the device communicators' policies: the workspace's growth
// (comm/cuda/workspace.h: never free a block a captured graph may replay into) and the NCCL
// communicator's watchdog (comm/cuda/watchdog.h: tickets in stream order, a deadline, the
// transport's asynchronous error), each driven by the test's own allocator and probes.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "comm/cuda/watchdog.h"
#include "comm/cuda/workspace.h"

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

TEST(GpuWorkspacePolicy, GrowthKeepsEarlierBlocksAliveUntilDestruction) {
  Heap heap;
  {
    Workspace ws = heap.make();
    void* a = ws.get(100, false);
    EXPECT_EQ(ws.capacity(), Workspace::kMinBytes);
    EXPECT_EQ(ws.get(Workspace::kMinBytes, false), a) << "no growth within the capacity";
    // A graph captured now would hold `a`; a larger eager call must not free it.
    void* b = ws.get(Workspace::kMinBytes + 1, false);
    EXPECT_NE(b, a);
    EXPECT_EQ(ws.capacity(), 2 * Workspace::kMinBytes) << "doubling";
    EXPECT_TRUE(heap.live.count(a)) << "the block a captured graph uses was freed";
    void* c = ws.get(size_t{1} << 20, false);
    EXPECT_EQ(ws.capacity(), size_t{1} << 20);
    EXPECT_TRUE(heap.live.count(a) && heap.live.count(b) && heap.live.count(c));
    EXPECT_EQ(ws.blocks(), 3u);
    EXPECT_EQ(heap.allocs, 3);
  }
  EXPECT_TRUE(heap.live.empty()) << "the destructor frees every block";
}

TEST(GpuWorkspacePolicy, NoGrowthWhileCapturingAndNoChangeOnFailure) {
  Heap heap;
  Workspace ws = heap.make();
  void* a = ws.get(10, false);
  EXPECT_EQ(ws.get(1000, true), a) << "capture within the capacity is fine";
  try {
    ws.get(size_t{1} << 20, true);
    ADD_FAILURE() << "grew during capture";
  } catch (const tpnorm::Error& e) {
    EXPECT_EQ(e.code(), tpnorm::ErrorCode::kInvalidArgument);
    EXPECT_NE(std::strstr(e.what(), "captured"), nullptr) << e.what();
  }
  heap.fail_next = true;
  EXPECT_THROW(ws.get(size_t{1} << 20, false), tpnorm::Error);
  EXPECT_EQ(ws.get(10, false), a) << "a failed growth keeps the current block";
  EXPECT_EQ(ws.capacity(), Workspace::kMinBytes);
  EXPECT_EQ(ws.blocks(), 1u);
}

TEST(GpuWorkspacePolicy, FitsAndOwnsDescribeTheCurrentBlock) {
  Heap heap;
  Workspace ws = heap.make();
  EXPECT_FALSE(ws.owns(&heap));
  char* a = static_cast<char*>(ws.get(10, false));
  const size_t cap = ws.capacity();
  EXPECT_TRUE(ws.owns(a) && ws.owns(a + cap - 1));
  EXPECT_FALSE(ws.owns(a + cap));
  EXPECT_TRUE(ws.fits(a, cap));
  EXPECT_TRUE(ws.fits(a + 256, cap - 256));
  EXPECT_FALSE(ws.fits(a + 256, cap - 255)) << "a collective longer than the block";
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
