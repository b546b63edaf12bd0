// bench.cpp — the benchmark harness (what `./launch/tpnorm bench` runs once per world size).
//
// Owns main, the op mode and the projection; the strategy mode is run_strategies.cpp. Op mode,
// per op, on every rank: warm up (the first calls run the strict pre-check collective, see
// Communicator::set_strict_calls), turn strict calls off, count one forward's and one
// backward's collectives and bytes, check the outputs against a float64 reference, then time
// forward + backward per iteration, split into phases by a communicator that wraps the real one
// and stamps each collective's entry and exit (timed_communicator.h). Each iteration's times
// are the slowest rank's; the row reports the median with min and max of the whole call. The
// bare all-reduce of the same payloads runs in the same job, and a fit of the cost model to
// bare all-reduces of several sizes gives the model column and the projection.
#include <mpi.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_flags.h"
#include "bench_io.h"
#include "launch_check.h"
#include "projection.h"
#include "run_strategies.h"
#include "timed_communicator.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_bench;

namespace {

struct Row {
  std::string op, shape;
  uint64_t fwd_bytes = 0, bwd_bytes = 0, hdr_bytes = 0, calls = 0;
  Series partial, reduce, apply, total;
  double bare = 0, model = 0;
  int64_t wrong = 0;
  bool bytes_ok = true;
};

Row run_op(const BenchOp& op, const Flags& f, Communicator& world, const Fits& fits) {
  const int rank = world.rank(), P = world.size();
  Row row;
  row.op = op.name;
  auto c = op.make(f.cfg, rank, P);
  row.shape = c->local_shape();
  TimedCommunicator timed(world);  // the op's communicator: counts and times its collectives

  timed.set_strict_calls(-1);  // warm-up calls run the strict pre-check, like a fresh communicator
  for (int i = 0; i < f.warmup; ++i) {
    c->forward(timed);
    c->backward(timed);
  }
  timed.set_strict_calls(0);  // measured calls: the header folded into the payload collective

  const DType wire = f.cfg.stats == Stats::kNaive   ? DType::F32
                     : f.cfg.stats == Stats::kExact ? DType::I64
                                                    : DType::F64;
  const uint64_t w = dtype_size(wire), hdr = header_values(NormOptions{}.check_agreement);
  timed.reset_counters();
  c->forward(timed);
  const CommCounters fc = timed.counters();
  timed.reset_counters();
  c->backward(timed);
  const CommCounters bc = timed.counters();
  row.fwd_bytes = fc.bytes_sent;
  row.bwd_bytes = bc.bytes_sent;
  row.hdr_bytes = hdr * w;
  row.calls = fc.calls + bc.calls;
  const bool one = forced_chunks() ? fc.calls >= 1 && bc.calls >= 1 : fc.calls == 1 && bc.calls == 1;
  row.bytes_ok = one &&
                 fc.bytes_sent == (c->payload_values(true) + hdr) * w &&
                 bc.bytes_sent == (c->payload_values(false) + hdr) * w;
  if (f.check) {
    int64_t wrong = c->count_wrong();
    MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    row.wrong = wrong;
  }

  for (int i = 0; i < f.iters; ++i) {
    if (rank == 0 && f.progress)
      std::fprintf(stderr, "\r[bench] world %d  %-10s iteration %d/%d ", P, op.name, i + 1,
                   f.iters);
    MPI_Barrier(MPI_COMM_WORLD);
    timed.reset_times();
    const double t0 = now_s();
    timed.begin();
    c->forward(timed);
    timed.end();
    timed.begin();
    c->backward(timed);
    timed.end();
    const PhaseTimes& pt = timed.times();
    std::array<double, 4> t{pt.partial, pt.reduce, pt.apply, now_s() - t0};
    MPI_Allreduce(MPI_IN_PLACE, t.data(), 4, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    row.partial.v.push_back(t[0]);
    row.reduce.v.push_back(t[1]);
    row.apply.v.push_back(t[2]);
    row.total.v.push_back(t[3]);
  }
  if (rank == 0 && f.progress) std::fprintf(stderr, "\r%60s\r", "");
  row.bare = bare_allreduce_s(world, {row.fwd_bytes / w, row.bwd_bytes / w}, wire, f.iters);
  row.model = ring_allreduce_seconds(fits.ar(), P, row.fwd_bytes) +
              ring_allreduce_seconds(fits.ar(), P, row.bwd_bytes);
  return row;
}

const char* dtype_flag(DType t) {
  return t == DType::F16 ? "fp16" : t == DType::BF16 ? "bf16" : "fp32";
}

// The row's fields in CSV / JSON order, with their table widths and headings.
std::vector<Field> fields(const Row& r, const Flags& f, int P) {
  const double us = 1e6, reduce = r.reduce.at(0.5);
  const double algbw = reduce > 0 ? (r.fwd_bytes + r.bwd_bytes) / reduce / 1e9 : 0;
  const double busbw = algbw * (P > 1 ? 2.0 * (P - 1) / P : 0);
  return {{"world", std::to_string(P), false, 5, "world"},
          {"op", r.op, true, -10, "op"},
          {"local_shape", r.shape, true, -11, "local"},
          {"dtype", dtype_flag(f.cfg.dtype), true, 5, "dtype"},
          {"stats",
           f.cfg.stats == Stats::kNaive   ? "naive"
           : f.cfg.stats == Stats::kExact ? "exact"
                                          : "robust",
           true, 6, "stats"},
          {"fwd_bytes", std::to_string(r.fwd_bytes), false, 9, "fwd_B"},
          {"bwd_bytes", std::to_string(r.bwd_bytes), false, 9, "bwd_B"},
          {"header_bytes", std::to_string(r.hdr_bytes), false, 6, "hdr_B"},
          {"collectives", std::to_string(r.calls), false, 5, "colls"},
          {"partial_us", fmt(r.partial.at(0.5) * us, "%.1f"), false, 9, "partial"},
          {"reduce_us", fmt(reduce * us, "%.1f"), false, 9, "reduce"},
          {"apply_us", fmt(r.apply.at(0.5) * us, "%.1f"), false, 9, "apply"},
          {"total_us", fmt(r.total.at(0.5) * us, "%.1f"), false, 9, "total"},
          {"total_min_us", fmt(r.total.at(0) * us, "%.1f"), false, 9, "min"},
          {"total_max_us", fmt(r.total.at(1) * us, "%.1f"), false, 9, "max"},
          {"bare_allreduce_us", fmt(r.bare * us, "%.1f"), false, 9, "bare"},
          {"model_us", fmt(r.model * us, "%.1f"), false, 9, "model"},
          {"algbw_GBs", fmt(algbw, "%.3g"), false, 9, "algbw"},
          {"busbw_GBs", fmt(busbw, "%.3g"), false, 9, "busbw"},
          {"wrong", std::to_string(r.wrong), false, 6, "#wrong"}};
}

void print_header(const Flags& f, int P) {
  std::string shape;
  for (int64_t d : f.cfg.shape) shape += (shape.empty() ? "" : "x") + std::to_string(d);
  std::printf(
      "# tpnorm bench: %s; layernorm/rmsnorm x %lldx%lld (hidden sharded), syncbn x %s "
      "NCHW (batch sharded); %d iterations after %d warm-up; one step = forward + "
      "backward\n",
      f.op.c_str(), (long long)f.cfg.rows, (long long)f.cfg.hidden, shape.c_str(), f.iters,
      f.warmup);
  std::printf(
      "# bytes: what each rank sends per call (communicator counters) = payload "
      "(docs/cpp-api.md, \"One collective per call\") + call header (hdr); strict pre-check off "
      "after warm-up\n");
  std::printf(
      "# times in us per step, median over iterations of the slowest rank; bare = the "
      "same payloads as two bare all-reduces; model = fitted ring all-reduce\n");
  std::printf("# algbw = (fwd+bwd bytes) / reduce time, busbw = algbw * 2(P-1)/P (nccl-tests)\n");
  Row empty;
  print_heading(fields(empty, f, P));
}

// The rate a large transfer saw. Over TCP the hosts' own per-byte cost (copies, the stack)
// adds to the link's rather than overlapping it, so the link's beta is the bandwidth-bound beta
// less that of the same hosts on an unlimited link (--host-beta); without it the rate printed
// is a lower bound on the link's.
void print_link(const Fits& fits, double host_beta_ns, int P) {
  const double bw = fits.beta_bw * 1e9;
  std::printf(
      "# bandwidth-bound at %d ranks from one-way sends (rank 2k to 2k+1) of 256 KiB..4 MiB: beta %.3g ns/B "
      "(%.3g GB/s)\n",
      P, bw, bw > 0 ? 1 / bw : 0);
  if (host_beta_ns < 0) {
    std::printf("# link: ~%.0f Mbit/s or faster (the hosts' own per-byte cost included; "
                "--host-beta subtracts it)\n",
                bw > 0 ? 8e3 / bw : 0);
  } else if (bw - host_beta_ns > 0.05 * bw) {
    const double link = bw - host_beta_ns;
    std::printf("# link: beta %.3g ns/B = %.3g - %.3g (the hosts' own): ~%.0f Mbit/s\n", link,
                bw, host_beta_ns, 8e3 / link);
  } else {
    std::printf("# link: not resolved: the bandwidth-bound beta %.3g ns/B is within 5 %% of the "
                "hosts' own %.3g ns/B (the link is about as fast as the hosts or faster)\n",
                bw, host_beta_ns);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  std::string error;
  const bool rank0 = launcher_rank() == 0;
  if (!parse_flags(argc, argv, f, error)) {
    if (rank0) std::fprintf(stderr, "tpnorm_bench: %s (see --help)\n", error.c_str());
    return 2;
  }
  if (f.help) {
    if (rank0) print_help(stdout);
    return 0;
  }
  if (f.check_flags) return 0;

  MPI_Init(&argc, &argv);
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  const int rank = world->rank(), P = world->size();
  const std::string mismatch = launch_mismatch(P);
  if (!mismatch.empty()) {
    if (rank0) std::fprintf(stderr, "tpnorm_bench: %s\n", mismatch.c_str());
    MPI_Finalize();
    return 3;
  }

  const bool strategies = !f.strategies.empty();
  const Fits fits = P > 1 ? fit_here(*world, f.iters, strategies) : Fits{};
  if (rank == 0 && P > 1) {
    const Link& a = fits.allreduce;
    std::printf(
        "# fitted at %d ranks from bare all-reduces of 64 B..1 MiB: alpha %.3g us per "
        "step, beta %.3g ns/B (%.3g GB/s)\n",
        P, a.alpha_ring * 1e6, a.beta * 1e9, a.beta > 0 ? 1e-9 / a.beta : 0);
    if (strategies) {
      const Link& g = fits.allgather;
      std::printf(
          "# fitted at %d ranks from bare all-gathers of 64 B..256 KiB per rank: alpha "
          "%.3g us per step, beta %.3g ns/B (%.3g GB/s)\n",
          P, g.alpha_ring * 1e6, g.beta * 1e9, g.beta > 0 ? 1e-9 / g.beta : 0);
    }
  }
  if (rank == 0 && P > 1) print_link(fits, f.host_beta_ns, P);
  if (strategies) {
    const int errors = run_strategies(f, *world, fits);
    MPI_Finalize();
    return errors ? 1 : 0;
  }

  std::vector<const BenchOp*> ops;
  for (const BenchOp& op : bench_ops())
    if (f.op == "all" || f.op == op.name) ops.push_back(&op);
  if (rank == 0 && f.header) print_header(f, P);
  std::vector<Projected> projected;
  int errors = 0;
  for (const BenchOp* op : ops) {
    const Row r = run_op(*op, f, *world, fits);
    if (rank == 0) {
      write_row(fields(r, f, P), f.csv, f.json);
      write_plotdata(f.plotdata, r.op, r.op, P, r.total);
      if (!r.bytes_ok)
        std::printf("# ERROR %s: bytes or collectives differ from the documented payload\n",
                    r.op.c_str());
      std::fflush(stdout);
    }
    const auto reduce = [](uint64_t b) { return Collective{Collective::kAllReduce, double(b), double(b)}; };
    const std::vector<Collective> fwd{reduce(r.fwd_bytes)}, bwd{reduce(r.bwd_bytes)};
    projected.push_back({r.op, [fwd, bwd](int, bool forward) { return forward ? fwd : bwd; }});
    errors += (r.wrong != 0) + !r.bytes_ok;
  }
  if (rank == 0 && f.project) project(projected, fits, P, f.proj);
  MPI_Finalize();
  return errors ? 1 : 0;
}
