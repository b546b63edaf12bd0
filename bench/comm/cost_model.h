// cost_model.h — the time of the collectives a strategy makes, on a topology
// (docs/benchmark.md, "Cost model").
//
// The structure is that of NCCL's own tuning model (src/graph/tuning.cc, ncclTopoTuneModel):
// a collective costs a base latency, a latency per step (NVLink steps inside a node, network
// steps between nodes), and its bytes over the bottleneck link. P ranks sit in N = ceil(P/G)
// nodes of G ranks (G >= P: one node; G = 1: every step crosses the network, a flat model).
//   ring all-reduce of B bytes: base_ring + 2(P-N) a_in + 2(N-1) a_net + 2(P-1)/P * B * beta
//   tree all-reduce of B bytes: base_tree + 2((P/N - 1) a_in + ceil(log2 N) a_net) + 2 B beta
//   all-reduce: the faster of the two (NCCL picks per call)
//   ring all-gather of b bytes per rank: base_ring + (P-N) a_in + (N-1) a_net + (P-1) b beta
//     (NCCL's all-gather has no tree)
//   all-to-all of b bytes per rank (b/P to each rank): NCCL's is P-1 concurrent sends and
//     receives, which its tuning model does not cover; here one step of latency and each link's
//     share: base_ring + a + max((G'-1)/P b beta_in, (P-G')/P b beta_net), G' = P/N ranks per
//     node, a = a_in when N = 1 else a_net (the intra-node and network parts at once)
// beta is the intra-node link's when N = 1, else the slower of the two links (the ring and the
// trees cross the network at the per-GPU network rate).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace tpnorm_bench {

/// One kind of link: latency per algorithm step (ring and tree differ in NCCL's tables) and
/// seconds per byte (1 / bandwidth per direction).
struct Link {
  double alpha_ring = 0, alpha_tree = 0, beta = 0;
};

struct Topology {
  std::string name;
  int gpus_per_node = 1;                // G: ranks per node sharing the intra-node link
  Link intra, net;                      // inside a node / between nodes
  double base_ring = 0, base_tree = 0;  // fixed latency per collective, seconds
};

/// A flat topology: every rank its own node, every step over `link`, no base latency.
Topology flat_topology(const std::string& name, const Link& link);

/// Seconds for one collective over P ranks on `t`; 0 for P < 2.
double ring_allreduce_seconds(const Topology& t, int P, double bytes);
double tree_allreduce_seconds(const Topology& t, int P, double bytes);
double allreduce_seconds(const Topology& t, int P, double bytes);  // min(ring, tree)
double allgather_seconds(const Topology& t, int P, double bytes_per_rank);
double alltoall_seconds(const Topology& t, int P, double bytes_per_rank);

/// Which algorithm a projection uses for its all-reduces.
enum class Algo { kRing, kTree, kBest };
double allreduce_seconds(const Topology& t, int P, double bytes, Algo a);

/// Least-squares fit (weights 1/t^2: relative error, so the small sizes count as much as the
/// large) of t = c0 + c1 * x to (x, t) samples; both clamped at >= 0.
std::pair<double, double> fit_line(const std::vector<std::pair<double, double>>& samples);

/// A flat link fitted at `P` >= 2 ranks from bare ring all-reduce timings (bytes, seconds):
/// t = 2(P-1) alpha + 2(P-1)/P B beta; alpha_tree = alpha_ring (one fitted latency per step).
Link fit_allreduce_link(int P, const std::vector<std::pair<double, double>>& samples);
/// The same from bare all-gathers (bytes per rank, seconds): t = (P-1) alpha + (P-1) b beta.
Link fit_allgather_link(int P, const std::vector<std::pair<double, double>>& samples);

/// Published figures (docs/benchmark.md has the table): "h100x8" (nodes of 8 H100 SXM on NVLink 4, one
/// InfiniBand NDR port per GPU), and "ndr_flat" (the same network with every rank its own node).
const std::vector<Topology>& topology_presets();
const Topology& topology_preset(const std::string& name);

}  // namespace tpnorm_bench
