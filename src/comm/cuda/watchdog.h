// watchdog.h — the watchdog of the NCCL communicator. An NCCL collective runs on the stream
// after the call has returned, so nothing on the calling thread can wait for it without
// synchronising; instead one host thread per communicator watches, in stream order, an event
// recorded after each collective ("ticket"), and the communicator's asynchronous error
// (ncclCommGetAsyncError). When a ticket is still pending after its deadline (a rank died or
// stopped calling), when its event reports an error, or when the transport reports one, the
// watchdog fires: the communicator's fire hook prints the message, aborts the NCCL
// communicator and ends the process (exit status 124), so mpirun ends the job instead of every
// rank hanging in the collective.
//
// Host code behind hooks (no CUDA types), so that a host unit test
// (tests/gpu/host_test_gpu_policies.cpp) drives it with its own probes without a GPU.
// Not watched: collectives replayed from a captured CUDA graph (nothing is enqueued by tpnorm
// then) and calls with Communicator::timeout() <= 0.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace tpnorm::detail {

class Watchdog {
 public:
  enum class State { kDone, kPending, kFailed };
  struct Hooks {
    /// Whether the collective of `ticket` has finished; on kFailed, *why says what failed.
    std::function<State(uint64_t ticket, std::string* why)> probe;
    /// The ticket is finished with: its event may be reused.
    std::function<void(uint64_t ticket)> release;
    /// The transport's asynchronous error, "" while there is none.
    std::function<std::string()> async_error;
    /// The message for an overdue ticket, from what watch() was given (built only on firing,
    /// so that watching costs no formatting per call).
    std::function<std::string(const char* what, uint64_t sequence)> describe;
    /// Ends the job with `message` (the production hook does not return; a test's may).
    std::function<void(const std::string& message)> fire;
    /// Runs first on the watchdog's thread (e.g. to make the device current); may be empty.
    std::function<void()> on_start;
  };

  /// `period`: how often pending tickets are probed; the async error is also polled every
  /// `idle_period` while nothing is pending.
  explicit Watchdog(Hooks hooks, std::chrono::microseconds period = std::chrono::milliseconds(1),
                    std::chrono::microseconds idle_period = std::chrono::milliseconds(100))
      : hooks_(std::move(hooks)),
        period_(period),
        idle_period_(idle_period),
        thread_([this] { loop(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// Watches `ticket` (enqueued on the stream after every earlier ticket): it must be done
  /// within `timeout_s` seconds from now, else the watchdog fires with describe(what,
  /// sequence). `what` must outlive the ticket (a string literal: the op's name).
  void watch(uint64_t ticket, double timeout_s, const char* what, uint64_t sequence) {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(timeout_s));
    {
      std::lock_guard<std::mutex> g(mu_);
      queue_.push_back({ticket, deadline, what, sequence});
    }
    cv_.notify_all();
  }

  size_t pending() const {
    std::lock_guard<std::mutex> g(mu_);
    return queue_.size();
  }
  bool fired() const {
    std::lock_guard<std::mutex> g(mu_);
    return fired_;
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Entry {
    uint64_t ticket;
    Clock::time_point deadline;
    const char* what;
    uint64_t sequence;
  };

  void loop() {
    if (hooks_.on_start) hooks_.on_start();
    std::unique_lock<std::mutex> lk(mu_);
    while (!stop_ && !fired_) {
      cv_.wait_for(lk, queue_.empty() ? idle_period_ : period_);
      if (stop_) break;
      std::string why;
      if (hooks_.async_error && !(why = hooks_.async_error()).empty()) {
        fire_locked(lk, why);
        break;
      }
      // In stream order: a ticket can only finish after the ones before it.
      while (!queue_.empty()) {
        Entry& e = queue_.front();
        const State s = hooks_.probe(e.ticket, &why);
        if (s == State::kDone) {
          hooks_.release(e.ticket);
          queue_.pop_front();
          continue;
        }
        if (s == State::kFailed)
          fire_locked(lk, hooks_.describe(e.what, e.sequence) + " (" + why + ")");
        else if (Clock::now() > e.deadline)
          fire_locked(lk, hooks_.describe(e.what, e.sequence));
        break;
      }
    }
  }

  // Fires outside the lock (the hook may take long, or a test's hook may call pending()).
  void fire_locked(std::unique_lock<std::mutex>& lk, const std::string& message) {
    fired_ = true;
    lk.unlock();
    hooks_.fire(message);
    lk.lock();
  }

  Hooks hooks_;
  std::chrono::microseconds period_, idle_period_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Entry> queue_;
  bool stop_ = false;
  bool fired_ = false;
  std::thread thread_;  // last: starts after everything above is constructed
};

}  // namespace tpnorm::detail
