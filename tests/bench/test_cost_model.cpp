// test_cost_model.cpp — the benchmark's cost model (bench/comm/cost_model.h) against numbers
// worked out by hand, and its fits recovering known links from exact samples.
//
// Flat link used below: alpha 1 us per step (ring and tree), beta 1 ns/B, no base latency.
// Hierarchical: nodes of G = 8; intra alpha 1 us, beta 1 ns/B; network alpha_ring 5 us,
// alpha_tree 10 us, beta 10 ns/B; base 2 us (ring), 3 us (tree).
#include <gtest/gtest.h>

#include "cost_model.h"
#include "strategies.h"

namespace {

using namespace tpnorm_bench;

constexpr double us = 1e-6, ns = 1e-9;

Topology flat() { return flat_topology("flat", Link{1 * us, 1 * us, 1 * ns}); }

Topology hier() {
  Topology t;
  t.name = "hier";
  t.gpus_per_node = 8;
  t.intra = Link{1 * us, 1 * us, 1 * ns};
  t.net = Link{5 * us, 10 * us, 10 * ns};
  t.base_ring = 2 * us;
  t.base_tree = 3 * us;
  return t;
}

TEST(CostModel, FlatRingAllReduce) {
  // 2(P-1) alpha + 2(P-1)/P B beta: P=4, B=8192: 6 us + 1.5 * 8192 ns = 18.288 us.
  EXPECT_NEAR(ring_allreduce_seconds(flat(), 4, 8192) / us, 18.288, 1e-9);
  // P=1024: 2046 us + 2 * 1023/1024 * 8.192 us = 2062.368 us.
  EXPECT_NEAR(ring_allreduce_seconds(flat(), 1024, 8192) / us, 2062.368, 1e-9);
  EXPECT_EQ(ring_allreduce_seconds(flat(), 1, 8192), 0.0);
}

TEST(CostModel, FlatTreeAllReduceAndTheFasterOfTheTwo) {
  // 2 ceil(log2 P) alpha + 2 B beta: P=4: 4 us + 16.384 us = 20.384 us (the ring wins);
  // P=1024: 20 us + 16.384 us = 36.384 us (the tree wins, by 56x).
  EXPECT_NEAR(tree_allreduce_seconds(flat(), 4, 8192) / us, 20.384, 1e-9);
  EXPECT_NEAR(allreduce_seconds(flat(), 4, 8192) / us, 18.288, 1e-9);
  EXPECT_NEAR(tree_allreduce_seconds(flat(), 1024, 8192) / us, 36.384, 1e-9);
  EXPECT_NEAR(allreduce_seconds(flat(), 1024, 8192) / us, 36.384, 1e-9);
  // P=3 (not a power of two): ceil(log2 3) = 2 steps up and down.
  EXPECT_NEAR(tree_allreduce_seconds(flat(), 3, 0) / us, 4.0, 1e-9);
}

TEST(CostModel, FlatRingAllGather) {
  // (P-1) alpha + (P-1) b beta: P=4, b=1000: 3 us + 3 us = 6 us.
  EXPECT_NEAR(allgather_seconds(flat(), 4, 1000) / us, 6.0, 1e-9);
}

TEST(CostModel, AllToAll) {
  // Flat: alpha + (P-1)/P b beta: P=4, b=4000: 1 us + 3 us = 4 us.
  EXPECT_NEAR(alltoall_seconds(flat(), 4, 4000) / us, 4.0, 1e-9);
  // One node of 8: 2 + 1 + 7/8 * 8000 * 1 ns = 10 us. Two nodes (P=16): 2 + 5 + the larger of
  // 7/16 * 8000 * 1 ns = 3.5 us (NVLink) and 8/16 * 8000 * 10 ns = 40 us (network) = 47 us.
  EXPECT_NEAR(alltoall_seconds(hier(), 8, 8000) / us, 10.0, 1e-9);
  EXPECT_NEAR(alltoall_seconds(hier(), 16, 8000) / us, 47.0, 1e-9);
  EXPECT_EQ(alltoall_seconds(hier(), 1, 8000), 0.0);
}

TEST(CostModel, HierarchicalOneNode) {
  // P=8 fits one node: NVLink only. Ring: 2 + 14 * 1 + 2 * 7/8 * 8192 * 1 ns = 30.336 us.
  // Tree (a chain inside the node): 3 + 2 * 7 * 1 + 2 * 8.192 = 33.384 us.
  EXPECT_NEAR(ring_allreduce_seconds(hier(), 8, 8192) / us, 30.336, 1e-9);
  EXPECT_NEAR(tree_allreduce_seconds(hier(), 8, 8192) / us, 33.384, 1e-9);
}

TEST(CostModel, HierarchicalTwoAndManyNodes) {
  // P=16: 2 nodes of 8. Ring: 2 + 2 * (16-2) * 1 + 2 * 1 * 5 + 2 * 15/16 * 8192 * 10 ns
  //   = 2 + 28 + 10 + 153.6 = 193.6 us. Tree: 3 + 2 * (7 * 1 + 1 * 10) + 2 * 8192 * 10 ns
  //   = 3 + 34 + 163.84 = 200.84 us.
  EXPECT_NEAR(ring_allreduce_seconds(hier(), 16, 8192) / us, 193.6, 1e-9);
  EXPECT_NEAR(tree_allreduce_seconds(hier(), 16, 8192) / us, 200.84, 1e-9);
  EXPECT_NEAR(allreduce_seconds(hier(), 16, 8192) / us, 193.6, 1e-9);
  // P=1024: 128 nodes. Ring: 2 + 2 * 896 * 1 + 2 * 127 * 5 + 2 * 1023/1024 * 81.92
  //   = 2 + 1792 + 1270 + 163.68 = 3227.68 us. Tree: 3 + 2 * (7 + 7 * 10) + 163.84 = 320.84 us.
  EXPECT_NEAR(ring_allreduce_seconds(hier(), 1024, 8192) / us, 3227.68, 1e-9);
  EXPECT_NEAR(allreduce_seconds(hier(), 1024, 8192) / us, 320.84, 1e-9);
  // All-gather, P=16, b=1000: 2 + (16-2) * 1 + 1 * 5 + 15 * 1000 * 10 ns = 171 us.
  EXPECT_NEAR(allgather_seconds(hier(), 16, 1000) / us, 171.0, 1e-9);
}

TEST(CostModel, PresetNodesOfEightPicksTheTreeForSmallPayloads) {
  // h100x8, tpnorm's LayerNorm call (512 rows: 2 * 512 + 10 values of 8 B = 8272 B) at 1024
  // ranks = 128 nodes: tree 6.8 + 2 * (7 * 0.6 + 7 * 5.0) + 2 * 8272 / 50e9 s
  //   = 6.8 + 78.4 + 0.33088 = 85.53088 us; ring 6.6 + 2 * 896 * 0.6 + 2 * 127 * 2.7
  //   + 2 * 1023/1024 * 8272 / 50e9 s = 6.6 + 1075.2 + 685.8 + 0.330557 = 1767.930557 us.
  const Topology& t = topology_preset("h100x8");
  EXPECT_NEAR(tree_allreduce_seconds(t, 1024, 8272) / us, 85.53088, 1e-6);
  EXPECT_NEAR(ring_allreduce_seconds(t, 1024, 8272) / us, 1767.930557, 1e-6);
  EXPECT_NEAR(allreduce_seconds(t, 1024, 8272) / us, 85.53088, 1e-6);
  EXPECT_THROW(topology_preset("no such preset"), std::invalid_argument);
}

TEST(CostModel, FitsRecoverTheLinkFromExactSamples) {
  // Ring all-reduce at P = 4 with alpha 2 us, beta 0.5 ns/B: t = 2 * 3 * 2 us + 2 * 3/4 B beta.
  std::vector<std::pair<double, double>> ar, ag;
  for (double b = 64; b <= 1 << 20; b *= 4) {
    ar.push_back({b, 12 * us + 1.5 * b * 0.5 * ns});
    ag.push_back({b, 3 * 2 * us + 3 * b * 0.5 * ns});  // all-gather: (P-1)(alpha + b beta)
  }
  const Link l = fit_allreduce_link(4, ar), g = fit_allgather_link(4, ag);
  EXPECT_NEAR(l.alpha_ring / us, 2.0, 1e-9);
  EXPECT_NEAR(l.beta / ns, 0.5, 1e-9);
  EXPECT_NEAR(g.alpha_ring / us, 2.0, 1e-9);
  EXPECT_NEAR(g.beta / ns, 0.5, 1e-9);
}

TEST(CostModel, StrategyPlansAndWireBytes) {
  BenchConfig c;
  c.rows = 512;
  c.hidden = 1024;
  // Bytes per rank per pass, at P = 4.
  auto bytes = [&](const char* name, bool fwd, int rank) {
    for (const BenchStrategy& s : bench_strategies())
      if (std::string(s.name) == name) {
        double b = 0;
        for (const Collective& k : s.plan(c, 4, rank, fwd)) b += k.bytes;
        return b;
      }
    ADD_FAILURE() << name;
    return 0.0;
  };
  EXPECT_EQ(bytes("tpnorm", true, 0), (2 * 512 + 10) * 8);
  EXPECT_EQ(bytes("two_pass", true, 0), 2 * 512 * 8);
  EXPECT_EQ(bytes("gather_row", true, 0), 512 * 256 * 4);
  EXPECT_EQ(bytes("gather_stats", true, 0), 3 * 512 * 8);
  EXPECT_EQ(bytes("gather_stats", false, 0), 2 * 512 * 8);
  c.kv_hidden = 256;  // QK-norm: q 1024 and k 256 columns per token
  EXPECT_EQ(bytes("qk_tpnorm", true, 0), (2 * 512 + 2 + 10) * 8);
  EXPECT_EQ(bytes("qk_two", false, 0), 2 * (512 + 10) * 8);
  EXPECT_EQ(bytes("qk_gather", true, 0), 512 * (256 + 64) * 4);
  // OLMo-core's route: q and k to whole rows and back, each rank's columns then its 128 rows;
  // backward the same plus the weights' gradients (1024 + 256 floats).
  EXPECT_EQ(bytes("qk_a2a", true, 0), 512 * (256 + 64) * 4 + 128 * (1024 + 256) * 4);
  EXPECT_EQ(bytes("qk_a2a", false, 0), 512 * (256 + 64) * 4 + 128 * (1024 + 256) * 4 +
                                           (1024 + 256) * 4);
  // Wire bytes: all-reduce 2(P-1)/P B, all-gather (P-1)/P of the gathered total, all-to-all
  // (P-1)/P of the bytes this rank sends.
  EXPECT_EQ(wire_bytes({{Collective::kAllReduce, 8192, 8192}}, 4), 12288);
  EXPECT_EQ(wire_bytes({{Collective::kAllGather, 1000, 4000}}, 4), 3000);
  EXPECT_EQ(wire_bytes({{Collective::kAllToAll, 1000, 4000}}, 4), 750);
}

}  // namespace
