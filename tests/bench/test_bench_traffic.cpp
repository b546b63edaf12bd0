// test_bench_traffic.cpp — the bytes and collectives the benchmark reports are the documented
// ones: for every op in the benchmark's table, the communicator's counters after one forward
// and one backward equal README "One collective per call" exactly (payload + call header, in
// the wire type), with and without the strict pre-check, and the op's own formula agrees.
// Also: the outputs the benchmark checks are right, and the phase timer sees every call.
#include <gtest/gtest.h>
#include <mpi.h>

#include <string>

#include "bench_op.h"
#include "harness.h"
#include "ops/phase_timer.h"
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

TEST(BenchTraffic, PhaseTimerSeesEveryCallOnlyWhenOn) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  auto c = bench_ops().front().make(BenchConfig{}, world->rank(), world->size());
  detail::PhaseTimes t;
  c->forward(*world);  // timer off: nothing recorded
  EXPECT_EQ(t.calls, 0u);
  detail::set_phase_timer(&t);
  c->forward(*world);
  c->backward(*world);
  detail::set_phase_timer(nullptr);
  c->forward(*world);
  EXPECT_EQ(t.calls, 2u);
}

}  // namespace
