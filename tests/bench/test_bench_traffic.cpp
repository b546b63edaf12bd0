// test_bench_traffic.cpp — the bytes and collectives the benchmark reports are the documented
// ones: for every op in the benchmark's table, the communicator's counters after one forward
// and one backward equal docs/cpp-api.md's "One collective per call" exactly (payload + call
// header, in the wire type), with and without the strict pre-check, and the op's own formula agrees.
// Every strategy of the comparison (--strategies) makes exactly the collectives and bytes of its
// plan (all-gathers counted beside the communicator) and matches the reference.
// Also: the outputs the benchmark checks are right, and the benchmark's timing communicator
// (a wrapper around the real one) forwards every collective and times only the calls it is told.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <string>

#include "bench_op.h"
#include "harness.h"
#include "strategies.h"
#include "timed_communicator.h"
#include "tpnorm/mpi.h"

namespace {

using namespace tpnorm;
using namespace tpnorm_bench;

// The slice table of an op whose ranks name their channel offsets: 2 values per rank at P > 1.
uint64_t slice_table(int P) { return P > 1 ? 2 * static_cast<uint64_t>(P) : 0; }

// The documented values per rank per call before the header. Written out here, not taken from the op.
uint64_t documented_values(const std::string& op, const BenchConfig& c, int P) {
  if (op == "layernorm") return 2 * static_cast<uint64_t>(c.rows);
  if (op == "rmsnorm") return static_cast<uint64_t>(c.rows);
  if (op == "syncbn") return 2 * static_cast<uint64_t>(c.shape[1]);  // 2 x C, count in header
  // One value per (row, group); 8 groups, or 1 (the whole row) when 8 does not divide hidden;
  // then the slice table.
  if (op == "rmsnormgated")
    return static_cast<uint64_t>(c.rows * (c.hidden % 8 == 0 ? 8 : 1)) + slice_table(P);
  ADD_FAILURE() << "no documented formula for op " << op;
  return 0;
}

TEST(BenchTraffic, CountersEqualTheDocumentedFormula) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  BenchConfig cfg;
  cfg.rows = 13;
  cfg.hidden = 7 * world->size() + 1;        // uneven shards
  cfg.shape = {world->size() + 1, 3, 2, 5};  // uneven batches
  for (const BenchOp& op : bench_ops()) {
    for (Stats mode : {Stats::kRobust, Stats::kNaive}) {
      SCOPED_TRACE(std::string(op.name) + (mode == Stats::kNaive ? " naive" : " robust"));
      cfg.stats = mode;
      auto c = op.make(cfg, world->rank(), world->size());
      const uint64_t w = mode == Stats::kRobust ? 8 : 4, header = 10;  // check_agreement on
      const uint64_t want = (documented_values(op.name, cfg, world->size()) + header) * w;
      EXPECT_EQ(c->payload_values(true), documented_values(op.name, cfg, world->size()));
      EXPECT_EQ(c->payload_values(false), documented_values(op.name, cfg, world->size()));

      // Strict: the header travels inside the call's one sum when header + payload fit a
      // size-checked sum (these small shapes), else in its own sum first; the same bytes in all.
      const uint64_t strict_calls = want <= world->size_checked_sum_bytes() ? 1u : 2u;
      world->set_strict_calls(-1);
      world->reset_counters();
      c->forward(*world);
      EXPECT_EQ(world->counters().calls, strict_calls);
      EXPECT_EQ(world->counters().bytes_sent, want);

      world->set_strict_calls(0);
      world->reset_counters();
      c->forward(*world);
      EXPECT_EQ(world->counters().calls, 1u);
      EXPECT_EQ(world->counters().bytes_sent, want);
      world->reset_counters();
      c->backward(*world);
      EXPECT_EQ(world->counters().calls, 1u);
      EXPECT_EQ(world->counters().bytes_sent, want);
      EXPECT_EQ(tpnorm_test::sum_over_ranks(c->count_wrong()), 0);
    }
  }
}

// Stats::kExact: int64 limbs (common/exact_sum.h), docs/exact-statistics.md,
// written out here: LayerNorm 13 a row forward (bad + 5 limbs of sum x + 7 of sum x^2) and 11
// backward, RMSNorm 8 and 6, SyncBatchNorm 13 and 11 a channel; the header in int64 too.
TEST(BenchTraffic, ExactCountersEqualTheDocumentedLimbs) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  BenchConfig cfg;
  cfg.rows = 13;
  cfg.hidden = 7 * world->size() + 1;
  cfg.shape = {world->size() + 1, 3, 2, 5};
  cfg.stats = Stats::kExact;
  for (const BenchOp& op : bench_ops()) {
    SCOPED_TRACE(op.name);
    const std::string n = op.name;
    const uint64_t per =
        n == "syncbn" ? static_cast<uint64_t>(cfg.shape[1]) : static_cast<uint64_t>(cfg.rows);
    // The gated RMSNorm: RMSNorm's limbs per (row, group); one group here (8 does not divide
    // hidden = 7P + 1).
    const bool rms = n == "rmsnorm" || n == "rmsnormgated";
    const uint64_t fwd = rms ? 8 : 13, bwd = rms ? 6 : 11;
    const uint64_t header = 10 + (n == "rmsnormgated" ? slice_table(world->size()) : 0);
    auto c = op.make(cfg, world->rank(), world->size());
    EXPECT_EQ(c->payload_values(true), fwd * per + header - 10);
    EXPECT_EQ(c->payload_values(false), bwd * per + header - 10);
    world->set_strict_calls(0);
    world->reset_counters();
    c->forward(*world);
    EXPECT_EQ(world->counters().calls, 1u);
    EXPECT_EQ(world->counters().bytes_sent, (fwd * per + header) * 8);
    world->reset_counters();
    c->backward(*world);
    EXPECT_EQ(world->counters().calls, 1u);
    EXPECT_EQ(world->counters().bytes_sent, (bwd * per + header) * 8);
    EXPECT_EQ(tpnorm_test::sum_over_ranks(c->count_wrong()), 0);
  }
}

// The wrapper forwards: the real communicator sees the same collectives and bytes, the results
// are right through it, and only calls between begin() and end() are timed.
TEST(BenchTraffic, TimedCommunicatorForwardsAndTimesEachCall) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  auto c = bench_ops().front().make(BenchConfig{}, world->rank(), world->size());
  TimedCommunicator timed(*world);
  timed.set_strict_calls(0);
  world->reset_counters();
  c->forward(timed);  // not between begin() and end(): not timed
  EXPECT_EQ(timed.times().calls, 0u);
  const auto t0 = std::chrono::steady_clock::now();
  timed.begin();
  c->forward(timed);
  timed.end();
  timed.begin();
  c->backward(timed);
  timed.end();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const PhaseTimes& t = timed.times();
  EXPECT_EQ(t.calls, 2u);
  // The phases partition each call: none negative, together within the calls' wall time.
  EXPECT_GE(t.partial, 0.0);
  EXPECT_GE(t.reduce, 0.0);
  EXPECT_GE(t.apply, 0.0);
  EXPECT_LE(t.partial + t.reduce + t.apply, wall);
  EXPECT_EQ(world->counters().calls, 3u);
  EXPECT_EQ(world->counters().bytes_sent, timed.counters().bytes_sent);
  EXPECT_EQ(tpnorm_test::sum_over_ranks(c->count_wrong()), 0);
}

// Uneven shards (hidden = 7P + 1), and a rank with no column (hidden < P at P >= 3), per
// strategy: the counted traffic of one forward and one backward equals the plan's, written
// out here once more for the all-gathers' per-rank blocks.
TEST(BenchTraffic, StrategiesMakeThePlannedCollectivesAndMatchTheReference) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  const int P = world->size(), me = world->rank();
  for (int64_t hidden : {int64_t{7} * P + 1, int64_t{2}}) {
    BenchConfig cfg;
    cfg.rows = 13;
    cfg.hidden = hidden;
    cfg.kv_hidden = hidden == 2 ? 1 : 3 * int64_t{P} + 2;  // the QK-norm strategies' k
    const int64_t mine = tpnorm_test::split_even(hidden, P).count[me];
    for (const BenchStrategy& s : bench_strategies()) {
      SCOPED_TRACE(std::string(s.name) + " hidden " + std::to_string(hidden));
      auto c = s.make(cfg, me, P);
      TimedCommunicator timed(*world);
      timed.set_strict_calls(0);
      for (bool fwd : {true, false}) {
        timed.reset_counters();
        timed.reset_external_counters();
        fwd ? c->forward(timed) : c->backward(timed);
        const auto plan = s.plan(cfg, P, me, fwd);
        // all-reduces on the communicator; all-gathers and all-to-alls beside it (external)
        uint64_t reduces = 0, others = 0, reduce_bytes = 0, other_bytes = 0;
        for (const Collective& k : plan) {
          const bool reduce = k.kind == Collective::kAllReduce;
          (reduce ? reduces : others) += 1;
          (reduce ? reduce_bytes : other_bytes) += static_cast<uint64_t>(k.bytes);
        }
        EXPECT_EQ(timed.counters().calls, reduces);
        EXPECT_EQ(timed.counters().bytes_sent, reduce_bytes);
        EXPECT_EQ(timed.external_counters().calls, others);
        EXPECT_EQ(timed.external_counters().bytes_sent, other_bytes);
      }
      const std::string n = s.name;
      const uint64_t R = 13;
      if (n == "gather_row") {
        EXPECT_EQ(timed.external_counters().bytes_sent, R * mine * 4);
      }
      if (n == "gather_stats") {
        EXPECT_EQ(timed.counters().bytes_sent, 2 * R * 8);
      }
      if (n == "qk_tpnorm") {  // one call for both: one header, a count and a float64 per row each
        EXPECT_EQ(timed.counters().bytes_sent, (2 * R + 2 + header_values(true)) * 8);
      }
      if (n == "qk_gather") {
        const int64_t kmine = tpnorm_test::split_even(cfg.kv_hidden, P).count[me];
        EXPECT_EQ(timed.external_counters().bytes_sent, R * (mine + kmine) * 4);
      }
      if (n == "qk_a2a") {  // backward: dy's columns out, this rank's tokens' dx rows back
        const int64_t kmine = tpnorm_test::split_even(cfg.kv_hidden, P).count[me];
        const int64_t tokens = tpnorm_test::split_even(13, P).count[me];
        EXPECT_EQ(timed.external_counters().bytes_sent,
                  (R * (mine + kmine) + tokens * (hidden + cfg.kv_hidden)) * 4);
        EXPECT_EQ(timed.counters().bytes_sent, (hidden + cfg.kv_hidden) * 4);
      }
      EXPECT_EQ(tpnorm_test::sum_over_ranks(c->count_wrong()), 0);
    }
  }
}

}  // namespace
