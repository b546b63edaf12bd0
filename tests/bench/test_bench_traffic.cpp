// test_bench_traffic.cpp — the bytes and collectives the benchmark reports are the documented
// ones: for every op in the benchmark's table, the communicator's counters after one forward
// and one backward equal README "One collective per call" exactly (payload + call header, in
// the wire type), with and without the strict pre-check, and the op's own formula agrees.
// Also: the outputs the benchmark checks are right, and the benchmark's timing communicator
// (a wrapper around the real one) forwards every collective and times only the calls it is told.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <string>

#include "bench_op.h"
#include "harness.h"
#include "timed_communicator.h"
#include "tpnorm/mpi.h"

namespace {

using namespace tpnorm;
using namespace tpnorm_bench;

// README: values per rank per call before the header. Written out here, not taken from the op.
uint64_t documented_values(const std::string& op, const BenchConfig& c) {
  if (op == "layernorm") return 2 * static_cast<uint64_t>(c.rows);
  if (op == "rmsnorm") return static_cast<uint64_t>(c.rows);
  if (op == "syncbn") return 2 * static_cast<uint64_t>(c.shape[1]);  // 2 x C, count in header
  ADD_FAILURE() << "no documented formula for op " << op;
  return 0;
}

TEST(BenchTraffic, CountersEqualTheDocumentedFormula) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  BenchConfig cfg;
  cfg.rows = 13;
  cfg.hidden = 7 * world->size() + 1;  // uneven shards
  cfg.shape = {world->size() + 1, 3, 2, 5};  // uneven batches
  for (const BenchOp& op : bench_ops()) {
    for (Stats mode : {Stats::kRobust, Stats::kNaive}) {
      SCOPED_TRACE(std::string(op.name) + (mode == Stats::kNaive ? " naive" : " robust"));
      cfg.stats = mode;
      auto c = op.make(cfg, world->rank(), world->size());
      const uint64_t w = mode == Stats::kRobust ? 8 : 4, header = 10;  // check_agreement on
      const uint64_t want = (documented_values(op.name, cfg) + header) * w;
      EXPECT_EQ(c->payload_values(true), documented_values(op.name, cfg));
      EXPECT_EQ(c->payload_values(false), documented_values(op.name, cfg));

      // Strict: the header travels in its own collective first, so two collectives per call
      // and the same bytes in all.
      world->set_strict_calls(-1);
      world->reset_counters();
      c->forward(*world);
      EXPECT_EQ(world->counters().calls, 2u);
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

}  // namespace
