// run_strategies.cpp — see run_strategies.h.
//
// Per strategy, on every rank: warm up (tpnorm's warm-up calls run its strict pre-check, as on
// a fresh communicator), count one forward's and one backward's collectives and bytes (the
// benchmark's communicator counts the all-reduces, its external() the all-gathers) and compare
// them with the strategy's plan, check the outputs against the float64 reference, then time
// `-n` steps: total per step and the time inside collectives (comm), each the slowest rank's.
#include "run_strategies.h"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <sstream>

#include "projection.h"
#include "strategies.h"
#include "timed_communicator.h"

namespace tpnorm_bench {
namespace {

struct StrategyRow {
  std::string shape;
  tpnorm::CommCounters fwd, bwd;  // measured: all-reduces + all-gathers
  double wire = 0, model = 0;
  Series total, comm;
  int64_t wrong = 0;
  bool traffic_ok = true;
};

tpnorm::CommCounters both(const TimedCommunicator& t) {
  tpnorm::CommCounters c = t.counters();
  c.calls += t.external_counters().calls;
  c.bytes_sent += t.external_counters().bytes_sent;
  return c;
}

bool matches(const tpnorm::CommCounters& c, const std::vector<Collective>& plan) {
  double bytes = 0;
  for (const Collective& k : plan) bytes += k.bytes;
  const bool calls = forced_chunks() ? c.calls >= plan.size() : c.calls == plan.size();
  return calls && static_cast<double>(c.bytes_sent) == bytes;
}

StrategyRow run_one(const BenchStrategy& s, const Flags& f, tpnorm::Communicator& world,
                    const Fits& fits) {
  const int rank = world.rank(), P = world.size();
  StrategyRow row;
  auto c = s.make(f.cfg, rank, P);
  row.shape = c->local_shape();
  TimedCommunicator timed(world);
  timed.set_strict_calls(-1);
  for (int i = 0; i < f.warmup; ++i) {
    c->forward(timed);
    c->backward(timed);
  }
  timed.set_strict_calls(0);

  const auto fwd_plan = s.plan(f.cfg, P, rank, true), bwd_plan = s.plan(f.cfg, P, rank, false);
  timed.reset_counters();
  timed.reset_external_counters();
  c->forward(timed);
  row.fwd = both(timed);
  timed.reset_counters();
  timed.reset_external_counters();
  c->backward(timed);
  row.bwd = both(timed);
  int ok = matches(row.fwd, fwd_plan) && matches(row.bwd, bwd_plan);
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  row.traffic_ok = ok != 0;
  if (f.check) {
    int64_t wrong = c->count_wrong();
    MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    row.wrong = wrong;
  }

  for (int i = 0; i < f.iters; ++i) {
    if (rank == 0 && f.progress)
      std::fprintf(stderr, "\r[bench] world %d  %-13s iteration %d/%d ", P, s.name, i + 1, f.iters);
    MPI_Barrier(MPI_COMM_WORLD);
    timed.reset_times();
    const double t0 = now_s();
    c->forward(timed);
    c->backward(timed);
    std::array<double, 2> t{now_s() - t0, timed.times().inside};
    MPI_Allreduce(MPI_IN_PLACE, t.data(), 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    row.total.v.push_back(t[0]);
    row.comm.v.push_back(t[1]);
  }
  if (rank == 0 && f.progress) std::fprintf(stderr, "\r%60s\r", "");
  const auto mean_fwd = s.plan(f.cfg, P, -1, true), mean_bwd = s.plan(f.cfg, P, -1, false);
  row.wire = wire_bytes(mean_fwd, P) + wire_bytes(mean_bwd, P);
  row.model = plan_seconds(mean_fwd, P, fits.ar(), fits.ag(), Algo::kBest) +
              plan_seconds(mean_bwd, P, fits.ar(), fits.ag(), Algo::kBest);
  return row;
}

std::vector<Field> fields(const BenchStrategy& s, const StrategyRow& r, const Flags& f, int P) {
  const double us = 1e6, total = r.total.at(0.5), comm = r.comm.at(0.5);
  const char* transport = std::getenv("TPNORM_TRANSPORT");
  return {{"world", std::to_string(P), false, 5, "world"},
          {"strategy", s.name, true, -12, "strategy"},
          {"transport", transport && *transport ? transport : "default", true, 0, ""},
          {"rows", std::to_string(f.cfg.rows), false, 0, ""},
          {"hidden", std::to_string(f.cfg.hidden), false, 0, ""},
          {"local_shape", r.shape, true, -10, "local"},
          {"fwd_collectives", std::to_string(r.fwd.calls), false, 4, "fwdC"},
          {"bwd_collectives", std::to_string(r.bwd.calls), false, 4, "bwdC"},
          {"fwd_bytes", std::to_string(r.fwd.bytes_sent), false, 8, "fwd_B"},
          {"bwd_bytes", std::to_string(r.bwd.bytes_sent), false, 8, "bwd_B"},
          {"wire_bytes_step", fmt(r.wire, "%.0f"), false, 9, "wire_B"},
          {"total_us", fmt(total * us, "%.1f"), false, 9, "total"},
          {"total_min_us", fmt(r.total.at(0) * us, "%.1f"), false, 9, "min"},
          {"total_max_us", fmt(r.total.at(1) * us, "%.1f"), false, 9, "max"},
          {"comm_us", fmt(comm * us, "%.1f"), false, 9, "comm"},
          {"compute_us", fmt((total - comm) * us, "%.1f"), false, 9, "compute"},
          {"model_us", fmt(r.model * us, "%.1f"), false, 9, "model"},
          {"traffic_ok", r.traffic_ok ? "1" : "0", false, 0, ""},
          {"wrong", std::to_string(r.wrong), false, 6, "#wrong"}};
}

// One line: the strategies fastest first, with their times; the measured line next to the
// model's (fitted on this job's link) shows whether the model orders them as the link does.
void print_ordering(const char* what, std::vector<std::pair<double, const char*>> t) {
  std::stable_sort(t.begin(), t.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::printf("# ordering, %s:", what);
  for (size_t i = 0; i < t.size(); ++i)
    std::printf("%s %s %.1f", i ? " <" : "", t[i].second, t[i].first * 1e6);
  std::printf(" (us per step)\n");
}

}  // namespace

int run_strategies(const Flags& f, tpnorm::Communicator& world, const Fits& fits) {
  const int rank = world.rank(), P = world.size();
  std::vector<const BenchStrategy*> chosen;
  for (const BenchStrategy& s : bench_strategies()) {
    const std::string family = s.family;
    bool want = (f.strategies == "all" && family == "layernorm") ||
                (f.strategies == "qk" && family == "qknorm") ||
                (f.strategies == "gated" && family == "gated");
    std::stringstream in(f.strategies);
    for (std::string name; std::getline(in, name, ',');) want |= name == s.name;
    if (want) chosen.push_back(&s);
  }
  if (rank == 0 && f.header) {
    if (std::string(chosen.front()->family) == "qknorm")
      std::printf(
          "# tpnorm bench --strategies: an attention's QK-norm, RMSNorm of q %lldx%lld and of "
          "k %lldx%lld fp32 (tokens x all heads' columns), heads sharded over the ranks; %d "
          "iterations after %d warm-up; one step = forward + backward\n",
          (long long)f.cfg.rows, (long long)f.cfg.hidden, (long long)f.cfg.rows,
          (long long)(f.cfg.kv_hidden > 0 ? f.cfg.kv_hidden : f.cfg.hidden), f.iters, f.warmup);
    else if (std::string(chosen.front()->family) == "gated")
      std::printf(
          "# tpnorm bench --strategies: Mamba-2's gated RMSNorm, x and z %lldx%lld fp32, gate "
          "first, 8 groups (1 when 8 does not divide the hidden size), channels sharded over "
          "the ranks; %d iterations after %d warm-up; one step = forward + backward\n",
          (long long)f.cfg.rows, (long long)f.cfg.hidden, f.iters, f.warmup);
    else
      std::printf(
          "# tpnorm bench --strategies: LayerNorm x %lldx%lld fp32, hidden sharded over "
          "the ranks; %d iterations after %d warm-up; one step = forward + backward\n",
          (long long)f.cfg.rows, (long long)f.cfg.hidden, f.iters, f.warmup);
    std::printf(
        "# fwdC/bwdC collectives per pass and fwd_B/bwd_B bytes this rank puts in them "
        "(counted; all-gather: its own block; all-to-all: all it sends), checked against each "
        "strategy's plan; "
        "wire_B = bytes per rank per step on the wire under ring algorithms\n");
    std::printf(
        "# times in us per step, median over iterations of the slowest rank; comm = "
        "inside collectives, compute = total - comm; model = fitted alpha-beta, flat\n");
    print_heading(fields(*chosen.front(), StrategyRow{}, f, P));
  }
  std::vector<Projected> projected;
  std::vector<std::pair<double, const char*>> measured, modelled;
  int errors = 0;
  for (const BenchStrategy* s : chosen) {
    const StrategyRow r = run_one(*s, f, world, fits);
    measured.push_back({r.comm.at(0.5), s->name});
    modelled.push_back({r.model, s->name});
    if (rank == 0) {
      write_row(fields(*s, r, f, P), f.csv, f.json);
      write_plotdata(f.plotdata, s->name, s->label, P, r.total);
      if (!r.traffic_ok)
        std::printf("# ERROR %s: collectives or bytes differ from the strategy's plan\n", s->name);
      std::fflush(stdout);
    }
    const BenchConfig cfg = f.cfg;
    projected.push_back(
        {s->name, [s, cfg](int Pp, bool fwd) { return s->plan(cfg, Pp, -1, fwd); }});
    errors += (r.wrong != 0) + !r.traffic_ok;
  }
  if (rank == 0 && P > 1 && chosen.size() > 1) {
    print_ordering("measured comm", measured);
    print_ordering("model comm   ", modelled);
  }
  if (rank == 0 && f.project) project(projected, fits, P, f.proj);
  return errors;
}

}  // namespace tpnorm_bench
