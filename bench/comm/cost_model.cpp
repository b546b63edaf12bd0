// cost_model.cpp — see cost_model.h.
#include "cost_model.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace tpnorm_bench {
namespace {

// Ranks per node and nodes for P ranks on t (NCCL: nRanks / nNodes ranks per node).
struct Layout {
  int per_node, nodes;
};
Layout layout(const Topology& t, int P) {
  const int g = std::max(1, std::min(t.gpus_per_node, P));
  const int nodes = (P + g - 1) / g;
  return {P / nodes, nodes};
}

// The bottleneck link's seconds per byte: NVLink inside one node, else the network's rate.
double beta(const Topology& t, int nodes) {
  return nodes > 1 ? std::max(t.intra.beta, t.net.beta) : t.intra.beta;
}

int ceil_log2(int n) {
  int k = 0;
  while ((1 << k) < n) ++k;
  return k;
}

}  // namespace

Topology flat_topology(const std::string& name, const Link& link) {
  Topology t;
  t.name = name;
  t.gpus_per_node = 1;
  t.intra = t.net = link;
  return t;
}

double ring_allreduce_seconds(const Topology& t, int P, double bytes) {
  if (P < 2) return 0;
  const Layout l = layout(t, P);
  return t.base_ring + 2.0 * (P - l.nodes) * t.intra.alpha_ring +
         2.0 * (l.nodes - 1) * t.net.alpha_ring + 2.0 * (P - 1) / P * bytes * beta(t, l.nodes);
}

double tree_allreduce_seconds(const Topology& t, int P, double bytes) {
  if (P < 2) return 0;
  const Layout l = layout(t, P);
  return t.base_tree +
         2.0 * ((l.per_node - 1) * t.intra.alpha_tree + ceil_log2(l.nodes) * t.net.alpha_tree) +
         2.0 * bytes * beta(t, l.nodes);
}

double allreduce_seconds(const Topology& t, int P, double bytes) {
  return std::min(ring_allreduce_seconds(t, P, bytes), tree_allreduce_seconds(t, P, bytes));
}

double allreduce_seconds(const Topology& t, int P, double bytes, Algo a) {
  return a == Algo::kRing   ? ring_allreduce_seconds(t, P, bytes)
         : a == Algo::kTree ? tree_allreduce_seconds(t, P, bytes)
                            : allreduce_seconds(t, P, bytes);
}

double allgather_seconds(const Topology& t, int P, double bytes_per_rank) {
  if (P < 2) return 0;
  const Layout l = layout(t, P);
  return t.base_ring + 1.0 * (P - l.nodes) * t.intra.alpha_ring +
         1.0 * (l.nodes - 1) * t.net.alpha_ring + (P - 1.0) * bytes_per_rank * beta(t, l.nodes);
}

double alltoall_seconds(const Topology& t, int P, double bytes_per_rank) {
  if (P < 2) return 0;
  const Layout l = layout(t, P);
  const double in_node = (l.per_node - 1.0) / P * bytes_per_rank * t.intra.beta;
  const double across = (P - 1.0 * l.per_node) / P * bytes_per_rank * t.net.beta;
  return t.base_ring + (l.nodes > 1 ? t.net.alpha_ring : t.intra.alpha_ring) +
         std::max(in_node, across);
}

std::pair<double, double> fit_line(const std::vector<std::pair<double, double>>& samples) {
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
  const double c1 = std::max(den > 0 ? (n * sxy - sx * sy) / den : 0, 0.0);
  const double c0 = n > 0 ? std::max((sy - c1 * sx) / n, 0.0) : 0;
  return {c0, c1};
}

// With P fixed a ring all-reduce is t = c0 + c1 B: c0 = 2(P-1) alpha, c1 = 2(P-1)/P beta.
Link fit_allreduce_link(int P, const std::vector<std::pair<double, double>>& samples) {
  const auto [c0, c1] = fit_line(samples);
  const double steps = 2.0 * std::max(P - 1, 1);
  Link l;
  l.alpha_ring = l.alpha_tree = c0 / steps;
  l.beta = c1 / (steps / std::max(P, 1));
  return l;
}

// A ring all-gather of b bytes per rank: t = c0 + c1 b, c0 = (P-1) alpha, c1 = (P-1) beta.
Link fit_allgather_link(int P, const std::vector<std::pair<double, double>>& samples) {
  const auto [c0, c1] = fit_line(samples);
  const double steps = std::max(P - 1, 1);
  Link l;
  l.alpha_ring = l.alpha_tree = c0 / steps;
  l.beta = c1 / steps;
  return l;
}

// Latencies: NCCL's tuning table (src/graph/tuning.cc, NCCL 2.18-2.23), protocol LL, which NCCL
// uses for payloads of a few KiB: per-step hwLat NVLink ring 0.6 us, tree 0.6 us; network ring
// 2.7 us, tree 5.0 us; per-call baseLat ring 6.6 us, tree 6.8 us. Bandwidths: NVLink 4 on H100
// SXM, 900 GB/s bidirectional = 450 GB/s per direction (NVIDIA H100 datasheet); one InfiniBand
// NDR port of 400 Gb/s = 50 GB/s per GPU (ConnectX-7; DGX H100: eight single-port 400 Gb/s
// ConnectX-7 for the compute fabric, one per GPU).
const std::vector<Topology>& topology_presets() {
  static const std::vector<Topology> presets = [] {
    const Link nvlink4{0.6e-6, 0.6e-6, 1.0 / 450e9}, ndr{2.7e-6, 5.0e-6, 1.0 / 50e9};
    Topology h100;
    h100.name = "h100x8";
    h100.gpus_per_node = 8;
    h100.intra = nvlink4;
    h100.net = ndr;
    h100.base_ring = 6.6e-6;
    h100.base_tree = 6.8e-6;
    Topology flat = flat_topology("ndr_flat", ndr);
    flat.base_ring = h100.base_ring;
    flat.base_tree = h100.base_tree;
    return std::vector<Topology>{h100, flat};
  }();
  return presets;
}

const Topology& topology_preset(const std::string& name) {
  for (const Topology& t : topology_presets())
    if (t.name == name) return t;
  throw std::invalid_argument("no topology preset " + name);
}

}  // namespace tpnorm_bench
