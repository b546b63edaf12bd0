// cost_model.cpp — see cost_model.h.
#include "cost_model.h"

#include <algorithm>

namespace tpnorm_bench {

double ring_allreduce_seconds(const LinkModel& m, int ranks, double bytes) {
  if (ranks < 2) return 0;
  const double steps = 2.0 * (ranks - 1);
  return steps * m.alpha + steps / ranks * bytes * m.beta;
}

// With P fixed the model is t = a + b*B: a = 2(P-1) alpha, b = 2(P-1)/P beta. Weights 1/t^2
// minimise the relative error, so the small (latency-bound) sizes count as much as the large.
LinkModel fit_link_model(int ranks, const std::vector<std::pair<double, double>>& samples) {
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [x, y] : samples) {
    const double w = y > 0 ? 1 / (y * y) : 0;
    n += w;
    sx += w * x;
    sy += w * y;
    sxx += w * x * x;
    sxy += w * x * y;
  }
  const double den = n * sxx - sx * sx;
  double b = den > 0 ? (n * sxy - sx * sy) / den : 0;
  b = std::max(b, 0.0);
  const double a = n > 0 ? std::max((sy - b * sx) / n, 0.0) : 0;
  const double steps = 2.0 * std::max(ranks - 1, 1);
  return {"fitted", a / steps, b / (steps / std::max(ranks, 1))};
}

// alpha: NCCL's own tuning model, per-step hardware latency of the ring with the LL protocol
// (src/graph/tuning.cc, hwLat: NVLink 0.4 us, network 0.9 us). beta: link bandwidth per
// direction, NVLink 4 on H100 SXM 450 GB/s (NVIDIA datasheet: 900 GB/s bidirectional) and one
// InfiniBand NDR port 400 Gb/s = 50 GB/s (ConnectX-7).
const std::vector<LinkModel>& link_presets() {
  static const std::vector<LinkModel> presets = {
      {"nvlink4", 0.4e-6, 1.0 / 450e9},
      {"ib_ndr", 0.9e-6, 1.0 / 50e9},
  };
  return presets;
}

}  // namespace tpnorm_bench
