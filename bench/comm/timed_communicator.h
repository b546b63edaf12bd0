// timed_communicator.h — phase times of an op measured from outside the library.
//
// A Communicator that forwards every all_reduce_sum to a real one and stamps the clock on
// entry and exit of the collective. Around one op call (begin() .. end()):
//   partial = call start -> first collective entry   (validation, agreement, local partials)
//   reduce  = first collective entry -> last exit     (the call's collective(s))
//   apply   = last collective exit -> call return     (the op's apply phase)
// With the strict pre-check off an op call makes exactly one collective, so reduce is that
// collective. The wrapper keeps its own counters (the base class counts every call), so the
// benchmark reads bytes and collectives from the communicator it hands to the op.
#pragma once

#include <chrono>
#include <cstdint>

#include "tpnorm/communicator.h"

namespace tpnorm_bench {

struct PhaseTimes {
  double partial = 0, reduce = 0, apply = 0;  // seconds, summed over the calls timed
  uint64_t calls = 0;                         // op calls that made at least one collective
};

class TimedCommunicator final : public tpnorm::Communicator {
 public:
  explicit TimedCommunicator(tpnorm::Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  tpnorm::Device device() const override { return inner_.device(); }

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

 protected:
  void do_all_reduce_sum(void* buf, size_t count, tpnorm::DType dtype) override {
    const double in = now();
    if (collectives_++ == 0) first_in_ = in;
    inner_.all_reduce_sum(buf, count, dtype);
    last_out_ = now();
  }

 private:
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  tpnorm::Communicator& inner_;
  PhaseTimes times_;
  double start_ = 0, first_in_ = 0, last_out_ = 0;
  int collectives_ = 0;
};

}  // namespace tpnorm_bench
