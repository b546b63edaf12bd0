// bench.cpp — the benchmark harness (what `./launch/tpnorm bench` runs once per world size).
//
// Owns main, flags, timing, checking and the report; the ops fill the table in bench_op.h.
// Per op, on every rank: warm up (the first calls run the strict pre-check collective, see
// Communicator::set_strict_calls), turn strict calls off, count one forward's and one
// backward's collectives and bytes, check the outputs against a float64 reference, then time
// forward + backward per iteration, split into phases by a communicator that wraps the real one
// and stamps each collective's entry and exit (timed_communicator.h). Each
// iteration's times are the slowest rank's; the row reports the median with min and max of the
// whole call. The bare all-reduce of the same payloads runs in the same job, and a fit of the
// alpha-beta model to bare all-reduces of several sizes gives the model column and projection.
#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <string>
#include <vector>

#include "bench_op.h"
#include "cost_model.h"
#include "timed_communicator.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_bench;

namespace {

struct Flags {
  BenchConfig cfg;
  std::string op = "all", csv, json, proj;
  int iters = 20, warmup = 5;
  bool header = false, project = false, check = true;
};

[[noreturn]] void usage_error(const std::string& what) {
  std::fprintf(stderr, "tpnorm_bench: %s\n", what.c_str());
  MPI_Abort(MPI_COMM_WORLD, 2);
  std::exit(2);
}

Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage_error("missing value after " + k);
      return argv[++i];
    };
    if (k == "--op") f.op = val();
    else if (k == "--rows") f.cfg.rows = std::atoll(val().c_str());
    else if (k == "--hidden") f.cfg.hidden = std::atoll(val().c_str());
    else if (k == "--shape") {
      f.cfg.shape.clear();
      const std::string s = val();
      for (size_t p = 0; p < s.size();) {
        const size_t q = s.find(',', p);
        f.cfg.shape.push_back(std::atoll(s.substr(p, q - p).c_str()));
        p = q == std::string::npos ? s.size() : q + 1;
      }
    } else if (k == "--dtype") {
      const std::string d = val();
      if (d == "fp32") f.cfg.dtype = DType::F32;
      else if (d == "fp16") f.cfg.dtype = DType::F16;
      else if (d == "bf16") f.cfg.dtype = DType::BF16;
      else usage_error("--dtype must be fp32, fp16 or bf16");
    } else if (k == "--stats") {
      const std::string s = val();
      if (s != "robust" && s != "naive") usage_error("--stats must be robust or naive");
      f.cfg.stats = s == "naive" ? Stats::kNaive : Stats::kRobust;
    } else if (k == "-n") f.iters = std::max(1, std::atoi(val().c_str()));
    else if (k == "-w") f.warmup = std::max(0, std::atoi(val().c_str()));
    else if (k == "--csv") f.csv = val();
    else if (k == "--json") f.json = val();
    else if (k == "--proj") f.proj = val();
    else if (k == "--header") f.header = true;
    else if (k == "--project") f.project = true;
    else if (k == "--no-check") f.check = false;
    else usage_error("unknown flag " + k);
  }
  if (f.cfg.rows < 1 || f.cfg.hidden < 1) usage_error("--rows and --hidden must be >= 1");
  if (f.cfg.shape.size() < 2 || f.cfg.shape.size() > 8 || f.cfg.shape[1] < 1)
    usage_error("--shape must be N,C[,spatial...] with C >= 1 and at most 8 dims");
  return f;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Per-iteration values, each the slowest rank's; median/min/max over iterations.
struct Series {
  std::vector<double> v;
  double at(double q) const {
    std::vector<double> s = v;
    std::sort(s.begin(), s.end());
    return s[static_cast<size_t>(q * (s.size() - 1) + 0.5)];
  }
};

// Median over `iters` of the slowest rank's time of two bare all-reduces (forward's and
// backward's payload) in the wire dtype.
double bare_allreduce_s(Communicator& c, size_t fwd_values, size_t bwd_values, DType wire,
                        int iters) {
  std::vector<double> buf(std::max(fwd_values, bwd_values) + 1, 0.0);
  Series s;
  for (int i = 0; i < iters; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t = now_s();
    c.all_reduce_sum(buf.data(), fwd_values, wire);
    c.all_reduce_sum(buf.data(), bwd_values, wire);
    t = now_s() - t;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    s.v.push_back(t);
  }
  return s.at(0.5);
}

LinkModel fit_here(Communicator& c, int iters) {
  std::vector<std::pair<double, double>> samples;
  for (size_t bytes = 64; bytes <= (1u << 20); bytes *= 4) {
    const size_t n = bytes / sizeof(double);
    // Both halves of bare_allreduce_s carry n values: half its time is one all-reduce.
    samples.push_back({static_cast<double>(bytes),
                       0.5 * bare_allreduce_s(c, n, n, DType::F64, iters)});
  }
  return fit_link_model(c.size(), samples);
}

struct Row {
  std::string op, shape;
  uint64_t fwd_bytes = 0, bwd_bytes = 0, hdr_bytes = 0, calls = 0;
  Series partial, reduce, apply, total;
  double bare = 0, model = 0;
  int64_t wrong = 0;
  bool bytes_ok = true;
};

Row run_op(const BenchOp& op, const Flags& f, Communicator& world, const LinkModel& fitted) {
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

  const DType wire = f.cfg.stats == Stats::kNaive ? DType::F32 : DType::F64;
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
  row.bytes_ok = fc.calls == 1 && bc.calls == 1 &&
                 fc.bytes_sent == (c->payload_values(true) + hdr) * w &&
                 bc.bytes_sent == (c->payload_values(false) + hdr) * w;
  if (f.check) {
    int64_t wrong = c->count_wrong();
    MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    row.wrong = wrong;
  }

  for (int i = 0; i < f.iters; ++i) {
    if (rank == 0)
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
  if (rank == 0) std::fprintf(stderr, "\r%60s\r", "");
  row.bare = bare_allreduce_s(world, row.fwd_bytes / w, row.bwd_bytes / w, wire, f.iters);
  row.model = ring_allreduce_seconds(fitted, P, row.fwd_bytes) +
              ring_allreduce_seconds(fitted, P, row.bwd_bytes);
  return row;
}

const char* dtype_flag(DType t) {
  return t == DType::F16 ? "fp16" : t == DType::BF16 ? "bf16" : "fp32";
}

// The row's fields in CSV / JSON order; the table on stdout shows the same values.
struct Field {
  const char* name;
  std::string value;
  bool text;  // quoted in JSON
};

std::vector<Field> fields(const Row& r, const Flags& f, int P) {
  auto num = [](double v, const char* fmt) {
    char b[48];
    std::snprintf(b, sizeof b, fmt, v);
    return std::string(b);
  };
  const double us = 1e6, reduce = r.reduce.at(0.5);
  const double algbw = reduce > 0 ? (r.fwd_bytes + r.bwd_bytes) / reduce / 1e9 : 0;
  const double busbw = algbw * (P > 1 ? 2.0 * (P - 1) / P : 0);
  return {{"world", std::to_string(P), false},
          {"op", r.op, true},
          {"local_shape", r.shape, true},
          {"dtype", dtype_flag(f.cfg.dtype), true},
          {"stats", f.cfg.stats == Stats::kNaive ? "naive" : "robust", true},
          {"fwd_bytes", std::to_string(r.fwd_bytes), false},
          {"bwd_bytes", std::to_string(r.bwd_bytes), false},
          {"header_bytes", std::to_string(r.hdr_bytes), false},
          {"collectives", std::to_string(r.calls), false},
          {"partial_us", num(r.partial.at(0.5) * us, "%.1f"), false},
          {"reduce_us", num(reduce * us, "%.1f"), false},
          {"apply_us", num(r.apply.at(0.5) * us, "%.1f"), false},
          {"total_us", num(r.total.at(0.5) * us, "%.1f"), false},
          {"total_min_us", num(r.total.at(0) * us, "%.1f"), false},
          {"total_max_us", num(r.total.at(1) * us, "%.1f"), false},
          {"bare_allreduce_us", num(r.bare * us, "%.1f"), false},
          {"model_us", num(r.model * us, "%.1f"), false},
          {"algbw_GBs", num(algbw, "%.3g"), false},
          {"busbw_GBs", num(busbw, "%.3g"), false},
          {"wrong", std::to_string(r.wrong), false}};
}

// Table widths, in the order of fields(); the header line in print_header uses the same.
constexpr int kWidth[] = {5, -10, -11, 5, 6, 9, 9, 6, 5, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 6};

FILE* open_append(const std::string& path) {
  FILE* out = std::fopen(path.c_str(), "a");
  if (!out) usage_error("cannot write " + path);
  return out;
}

void report(const Row& r, const Flags& f, int P) {
  const std::vector<Field> row = fields(r, f, P);
  for (size_t i = 0; i < row.size(); ++i)
    std::printf("%s%*s", i ? " " : "", kWidth[i], row[i].value.c_str());
  std::printf("\n");
  if (!f.csv.empty()) {
    FILE* out = open_append(f.csv);
    if (std::ftell(out) == 0)
      for (size_t i = 0; i < row.size(); ++i)
        std::fprintf(out, "%s%s", row[i].name, i + 1 < row.size() ? "," : "\n");
    for (size_t i = 0; i < row.size(); ++i)
      std::fprintf(out, "%s%s", row[i].value.c_str(), i + 1 < row.size() ? "," : "\n");
    std::fclose(out);
  }
  if (!f.json.empty()) {  // one object per line; the launcher wraps the lines in a list
    FILE* out = open_append(f.json);
    for (size_t i = 0; i < row.size(); ++i)
      std::fprintf(out, "%s\"%s\": %s%s%s%s", i ? ", " : "{", row[i].name,
                   row[i].text ? "\"" : "", row[i].value.c_str(), row[i].text ? "\"" : "",
                   i + 1 < row.size() ? "" : "}\n");
    std::fclose(out);
  }
}

void print_header(const Flags& f) {
  std::string shape;
  for (int64_t d : f.cfg.shape) shape += (shape.empty() ? "" : "x") + std::to_string(d);
  std::printf("# tpnorm bench: %s; layernorm/rmsnorm x %lldx%lld (hidden sharded), syncbn x %s "
              "NCHW (batch sharded); %d iterations after %d warm-up; one step = forward + "
              "backward\n",
              f.op.c_str(), (long long)f.cfg.rows, (long long)f.cfg.hidden, shape.c_str(),
              f.iters, f.warmup);
  std::printf("# bytes: what each rank sends per call (communicator counters) = payload (README \"One collective per call\") "
              "+ call header (hdr); strict pre-check off after warm-up\n");
  std::printf("# times in us per step, median over iterations of the slowest rank; bare = the "
              "same payloads as two bare all-reduces; model = fitted alpha-beta ring\n");
  std::printf("# algbw = (fwd+bwd bytes) / reduce time, busbw = algbw * 2(P-1)/P (nccl-tests)\n");
  const char* names[] = {"world", "op", "local", "dtype", "stats", "fwd_B", "bwd_B",
                         "hdr_B", "colls", "partial", "reduce", "apply", "total", "min",
                         "max", "bare", "model", "algbw", "busbw", "#wrong"};
  std::printf("#");
  for (size_t i = 0; i < std::size(names); ++i)
    std::printf("%s%*s", i ? " " : "", i ? kWidth[i] : kWidth[0] - 1, names[i]);
  std::printf("\n");
}

// Communication time per step at larger world sizes: the same bytes per rank (they do not
// depend on P for these ops), two ring all-reduces, under the fitted and the preset links.
void project(const std::vector<Row>& rows, const LinkModel& fitted, const Flags& f) {
  std::vector<LinkModel> models{fitted};
  for (const LinkModel& m : link_presets()) models.push_back(m);
  FILE* out = f.proj.empty() ? nullptr : std::fopen(f.proj.c_str(), "w");
  if (out) std::fprintf(out, "op,model,world,comm_us\n");
  std::printf("# projected communication time per step (us): model alpha(us) beta(ns/B)\n");
  for (const Row& r : rows) {
    for (const LinkModel& m : models) {
      std::printf("# %-10s %-7s a=%.3g b=%.3g:", r.op.c_str(), m.name, m.alpha * 1e6,
                  m.beta * 1e9);
      for (int P = 16; P <= 1024; P *= 2) {
        const double t = ring_allreduce_seconds(m, P, r.fwd_bytes) +
                         ring_allreduce_seconds(m, P, r.bwd_bytes);
        std::printf(" P%d=%.1f", P, t * 1e6);
        if (out) std::fprintf(out, "%s,%s,%d,%.4f\n", r.op.c_str(), m.name, P, t * 1e6);
      }
      std::printf("\n");
    }
  }
  if (out) std::fclose(out);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const Flags f = parse(argc, argv);
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  const int rank = world->rank(), P = world->size();

  std::vector<const BenchOp*> ops;
  for (const BenchOp& op : bench_ops())
    if (f.op == "all" || f.op == op.name) ops.push_back(&op);
  if (ops.empty()) usage_error("unknown --op " + f.op);

  const LinkModel fitted = P > 1 ? fit_here(*world, f.iters) : LinkModel{"fitted", 0, 0};
  if (rank == 0) {
    if (f.header) print_header(f);
    if (P > 1)
      std::printf("# fitted at %d ranks from bare all-reduces of 64 B..1 MiB: alpha %.3g us per "
                  "step, beta %.3g ns/B (%.3g GB/s)\n",
                  P, fitted.alpha * 1e6, fitted.beta * 1e9, fitted.beta > 0 ? 1e-9 / fitted.beta : 0);
  }
  std::vector<Row> rows;
  int errors = 0;
  for (const BenchOp* op : ops) {
    rows.push_back(run_op(*op, f, *world, fitted));
    const Row& r = rows.back();
    if (rank == 0) {
      report(r, f, P);
      if (!r.bytes_ok)
        std::printf("# ERROR %s: bytes or collectives differ from the README formula\n",
                    r.op.c_str());
      std::fflush(stdout);
    }
    errors += (r.wrong != 0) + !r.bytes_ok;
  }
  if (rank == 0 && f.project && P > 1) project(rows, fitted, f);
  MPI_Finalize();
  return errors ? 1 : 0;
}
