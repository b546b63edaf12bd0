// timed_communicator.h — phase times of an op measured from outside the library.
//
// A Communicator that forwards every sum (blocking, or started and waited) to a real one and
// stamps the clock on entry and exit of each collective. Around one op call (begin() .. end()):
//   partial = call start -> first collective entry   (validation, agreement, local partials)
//   reduce  = first collective entry -> last exit     (the call's collective(s))
//   apply   = last collective exit -> call return     (the op's apply phase)
//   inside  = the time spent inside collectives      (= reduce for one collective per call)
// With the strict pre-check off a tpnorm call makes exactly one collective, so reduce is that
// collective. The wrapper keeps its own counters (the base class counts every sum), so the
// benchmark reads bytes and collectives from the communicator it hands to the op. Collectives
// the benchmark makes beside the communicator (the all-gathers of the other strategies, over
// MPI on the same ranks) go through external(), timed the same way and counted apart.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <utility>

#include "tpnorm/communicator.h"

namespace tpnorm_bench {

struct PhaseTimes {
  double partial = 0, reduce = 0, apply = 0, inside = 0;  // seconds, summed over the calls
  uint64_t calls = 0;  // op calls that made at least one collective
};

class TimedCommunicator final : public tpnorm::Communicator {
 public:
  explicit TimedCommunicator(tpnorm::Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  tpnorm::Device device() const override { return inner_.device(); }
  size_t size_checked_sum_bytes() const override { return inner_.size_checked_sum_bytes(); }

  /// Marks the start of one op call; end() after it returns adds its phases to times().
  void begin() {
    start_ = now();
    first_in_ = last_out_ = start_;
    collectives_ = 0;
  }
  void end() {
    const double stop = now();
    if (collectives_ == 0) return;  // a call without a collective has no phases to split
    times_.partial += first_in_ - start_;
    times_.reduce += last_out_ - first_in_;
    times_.apply += stop - last_out_;
    ++times_.calls;
  }
  const PhaseTimes& times() const { return times_; }
  void reset_times() { times_ = {}; }

  /// Runs `f`, a collective of `bytes` from this rank made beside this communicator on the same
  /// ranks, timed like the communicator's own and counted in external_counters().
  template <class F>
  void external(uint64_t bytes, F&& f) {
    external_.calls += 1;
    external_.bytes_sent += bytes;
    enter();
    f();
    leave();
  }
  const tpnorm::CommCounters& external_counters() const { return external_; }
  void reset_external_counters() { external_ = {}; }

 protected:
  void do_all_reduce_sum(void* buf, size_t count, tpnorm::DType dtype) override {
    enter();
    inner_.all_reduce_sum(buf, count, dtype);
    leave();
  }
  // A started sum is inside its collective from start to wait.
  void do_start_all_reduce_sum(uint64_t id, void* buf, size_t count, tpnorm::DType dtype) override {
    enter();
    pending_[id] = inner_.start_all_reduce_sum(buf, count, dtype);
  }
  void do_progress_in_background() override { inner_.progress_in_background(); }
  void do_wait(uint64_t id) override {
    Request r = std::move(pending_[id]);
    pending_.erase(id);
    inner_.wait(r);
    leave();
  }

 private:
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  // Nested (overlapping started sums) count once in `inside`.
  void enter() {
    const double t = now();
    if (collectives_++ == 0) first_in_ = t;
    if (depth_++ == 0) segment_ = t;
  }
  void leave() {
    last_out_ = now();
    if (--depth_ == 0) times_.inside += last_out_ - segment_;
  }

  tpnorm::Communicator& inner_;
  PhaseTimes times_;
  tpnorm::CommCounters external_;
  std::map<uint64_t, Request> pending_;
  double start_ = 0, first_in_ = 0, last_out_ = 0, segment_ = 0;
  int collectives_ = 0, depth_ = 0;
};

/// Whether TPNORM_CHUNK forces row chunks ("on" or a row count; docs/chunking.md): then
/// a strict-off call is chunked too, and makes the header's sum plus one sum per chunk — the
/// same bytes as one collective, more collectives. (Auto chunks only strict calls, and the
/// measured calls here are not strict.)
inline bool forced_chunks() {
  const char* v = std::getenv("TPNORM_CHUNK");
  return v && (std::strcmp(v, "on") == 0 || std::atoll(v) > 0);
}

}  // namespace tpnorm_bench
