// run_strategies.h — the benchmark's strategy mode (--strategies): the LayerNorm strategies of
// strategies.h on the same shapes, each counted, checked and timed like an op, then projected.
#pragma once

#include "bench_flags.h"
#include "bench_io.h"
#include "tpnorm/communicator.h"

namespace tpnorm_bench {

/// Runs the strategies `f.strategies` names on `world`; returns the number of failed rows
/// (wrong elements, or traffic that differs from the strategy's plan).
int run_strategies(const Flags& f, tpnorm::Communicator& world, const Fits& fits);

}  // namespace tpnorm_bench
