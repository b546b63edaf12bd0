// projection.h — communication time per step beyond this machine: each measured op or
// strategy's collectives (its plan) under the cost model, for P = 2 .. 1024, on the topology
// fitted in this job (flat) and on the presets (cost_model.h); and the rows the plot reads.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "bench_io.h"
#include "strategies.h"

namespace tpnorm_bench {

struct Projected {
  std::string name;
  /// The collectives of one pass (forward: true) at P ranks.
  std::function<std::vector<Collective>(int P, bool forward)> plan;
};

/// Prints the projection (a few world sizes per line) and, when `csv` is set, writes every
/// number to it: name,topology,algo,world,comm_us with algo ring, tree or best (the faster).
/// `fitted_at` is this job's world size (no fitted rows when it is 1).
void project(const std::vector<Projected>& items, const Fits& fits, int fitted_at,
             const std::string& csv);

/// Appends one measured point for the plot: name|label|world|median_us|min_us of the step.
void write_plotdata(const std::string& path, const std::string& name, const std::string& label,
                    int P, const Series& total);

}  // namespace tpnorm_bench
