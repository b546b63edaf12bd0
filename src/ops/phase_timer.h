// phase_timer.h — optional wall-clock timing of an op's three phases, for the benchmark.
//
// Off unless a caller installs a PhaseTimes on its thread (set_phase_timer); then every call's
// PackedCall adds to it. PackedCall marks the boundaries, so no op needs timing code:
//   partial = construction .. reduce() starts   (validation, agreement fields, local partials)
//   reduce  = reduce() itself                   (header, the collective(s), header check)
//   apply   = reduce() ends .. call destroyed   (the op's apply phase, at the end of its scope)
// When off, the cost per call is one thread-local load and a null test.
#pragma once

#include <cstdint>

namespace tpnorm::detail {

struct PhaseTimes {
  double partial = 0, reduce = 0, apply = 0;  // seconds, summed over calls
  uint64_t calls = 0;                         // calls whose reduce() completed
};

/// The timer of this thread; nullptr (the default) turns timing off.
PhaseTimes* phase_timer();
void set_phase_timer(PhaseTimes* t);

}  // namespace tpnorm::detail
