// cost_model.h — the alpha-beta model of a ring all-reduce (README "Benchmark"):
// t(B, P) = 2(P-1) * alpha + 2(P-1)/P * B * beta, alpha in seconds per step, beta in seconds per
// byte. Fitted from bare all-reduce timings, or taken from a published preset.
#pragma once

#include <utility>
#include <vector>

namespace tpnorm_bench {

struct LinkModel {
  const char* name;
  double alpha;  // seconds per ring step (latency)
  double beta;   // seconds per byte (1 / bus bandwidth)
};

/// Ring all-reduce time of `bytes` over `ranks` under `m`; 0 for one rank.
double ring_allreduce_seconds(const LinkModel& m, int ranks, double bytes);

/// Least-squares fit of alpha and beta (each clamped at >= 0) from (bytes, seconds) samples of a
/// bare all-reduce over `ranks` >= 2 ranks.
LinkModel fit_link_model(int ranks, const std::vector<std::pair<double, double>>& samples);

/// Published figures (see the README, "Benchmark"): NVLink 4 and InfiniBand NDR.
const std::vector<LinkModel>& link_presets();

}  // namespace tpnorm_bench
