// micro_main.cpp — the harness behind micro.h: registration, the memory limit, and the table.
//
// The memory limit for a case is the faster of memcpy and the streaming-store copy
// (stream_copy.h) moving the same bytes (half read, half written) with the same
// thread count, measured in the same run. The table uses each benchmark's median over the
// repetitions (--benchmark_repetitions), or its only run without repetitions.
//
// Mode pairs (add_mode_pair): the two statistics modes of an op in ONE benchmark, called
// alternately (robust, exact, then exact, robust, ...) and each call timed by itself, so that
// load from other processes falls on both alike; the ratio is the median over pairs of
// t_robust / t_exact, per repetition, then the median over repetitions like everything else.
#include <benchmark/benchmark.h>
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "micro.h"
#include "peers.h"
#include "stream_copy.h"

namespace tpnorm_perf {
namespace {

struct Case {
  std::string op, pass, shape;
  int64_t bytes;
  std::function<Call()> make;
  int64_t moved;  // the bytes really moved (== bytes for a one-pass op)
};
std::vector<Case>& cases() {
  static std::vector<Case> c;
  return c;
}

struct PairCase {
  std::string op, pass, shape;
  int64_t bytes;
  std::function<ModePair()> make;
};
std::vector<PairCase>& pair_cases() {
  static std::vector<PairCase> c;
  return c;
}

struct PeerCase {
  std::string lib;
  Problem p;
  std::function<PeerCall(int)> make;
};
std::vector<PeerCase>& peer_cases() {
  static std::vector<PeerCase> c;
  return c;
}

constexpr int kThreads[] = {1, 2};
constexpr int kPairsPerIteration = 5;  // so that even one iteration gives a median

std::string case_name(const Case& c, int t) {
  return c.op + "/" + c.pass + "/" + c.shape + "/threads:" + std::to_string(t);
}
std::string pair_name(const PairCase& c, int t) {
  return c.op + "/" + c.pass + "/" + c.shape + "/exact-vs-robust/threads:" + std::to_string(t);
}
std::string limit_name(const char* kind, int64_t bytes, int t) {
  return std::string("limit/") + kind + "/" + std::to_string(bytes >> 20) +
         "MiB/threads:" + std::to_string(t);
}

struct Aligned {
  void operator()(float* p) const { std::free(p); }
};
std::unique_ptr<float, Aligned> alloc(int64_t n) {
  const size_t b = (static_cast<size_t>(n) * sizeof(float) + 63) / 64 * 64;
  auto* p = static_cast<float*>(std::aligned_alloc(64, b));
  std::memset(p, 1, b);  // fault the pages in before timing
  return std::unique_ptr<float, Aligned>(p);
}

// Each thread copies one contiguous slice, as the kernels split rows.
void copy_bench(benchmark::State& st, int64_t bytes, int threads, bool streaming) {
  const int64_t n = bytes / 2 / static_cast<int64_t>(sizeof(float));
  auto src = alloc(n), dst = alloc(n);
  for (auto _ : st) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t lo = n * omp_get_thread_num() / threads;
      const int64_t hi = n * (omp_get_thread_num() + 1) / threads;
      if (streaming) {
        stream_copy(dst.get() + lo, src.get() + lo, hi - lo);
        stream_fence();
      } else {
        std::memcpy(dst.get() + lo, src.get() + lo, static_cast<size_t>(hi - lo) * sizeof(float));
      }
    }
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(st.iterations() * bytes);
}

// One thread runs on the benchmark's own thread, so its CPU time is the op's time without
// the intervals the core spent on other processes (the machine is shared). Several threads
// are timed by the wall clock. Ops and copies of a thread count use the same clock.
void clock(int threads, benchmark::internal::Benchmark* b) {
  b->Unit(benchmark::kMillisecond);
  if (threads > 1) b->UseRealTime();
}

// The clock of a thread count, as clock() below: one thread's CPU time, else the wall clock.
double seconds(int threads) {
  timespec ts;
  clock_gettime(threads > 1 ? CLOCK_MONOTONIC : CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void pair_bench(benchmark::State& st, const PairCase& c, int threads) {
  const ModePair m = c.make();
  // Warm-up (first touch of the output pages), and one call's payload in each mode.
  const uint64_t b0 = m.bytes_sent();
  m.robust(threads);
  const uint64_t b1 = m.bytes_sent();
  m.exact(threads);
  const uint64_t b2 = m.bytes_sent();
  std::vector<double> tr, te, ratio;
  for (auto _ : st) {
    for (int i = 0; i < kPairsPerIteration; ++i) {
      const bool exact_first = ratio.size() % 2 == 1;  // neither mode always runs second
      const Call& first = exact_first ? m.exact : m.robust;
      const Call& second = exact_first ? m.robust : m.exact;
      const double t0 = seconds(threads);
      first(threads);
      const double t1 = seconds(threads);
      second(threads);
      const double t2 = seconds(threads);
      const double r = exact_first ? t2 - t1 : t1 - t0, e = exact_first ? t1 - t0 : t2 - t1;
      tr.push_back(r);
      te.push_back(e);
      ratio.push_back(r / e);
    }
  }
  const double bytes = static_cast<double>(c.bytes);
  st.counters["robust_GBps"] = bytes / median(tr) / 1e9;
  st.counters["exact_GBps"] = bytes / median(te) / 1e9;
  st.counters["exact_over_robust"] = median(ratio);
  st.counters["robust_B"] = static_cast<double>(b1 - b0);
  st.counters["exact_B"] = static_cast<double>(b2 - b1);
}

// A peer's benchmark: its make (which checks its output against tpnorm's) outside the timed
// loop; a failed check is printed once and kept as the benchmark's label. Google Benchmark calls a benchmark's function again for each estimate of the iterations
// and each repetition: the last peer made is kept for the next call of the same benchmark (only
// one, so that one case's tensors are alive at a time).
struct LastPeer {
  std::string name;
  Call call;
  std::map<std::string, std::string> mismatch;  // by benchmark name
};
LastPeer& last_peer() {
  static LastPeer p;
  return p;
}

void register_peers() {
  for (const PeerCase& c : peer_cases())
    for (int t : kThreads) {
      const std::string name = "peer/" + c.lib + "/" + c.p.tpnorm_name(t);
      const int64_t bytes = c.p.bytes();
      clock(t, benchmark::RegisterBenchmark(name.c_str(), [c, t, name, bytes](benchmark::State& st) {
              LastPeer& last = last_peer();
              if (last.name != name) {
                last.name.clear();
                last.call = nullptr;  // the previous peer's tensors go first
                try {
                  PeerCall pc = c.make(t);
                  last.call = std::move(pc.call);
                  if (!pc.mismatch.empty()) {
                    std::fprintf(stderr, "error: %s: %s\n", name.c_str(), pc.mismatch.c_str());
                    last.mismatch[name] = "MISMATCH: " + pc.mismatch;
                  }
                } catch (const std::exception& e) {
                  last.call = nullptr;
                  std::fprintf(stderr, "error: %s: %s\n", name.c_str(), e.what());
                  st.SkipWithError(e.what());
                  return;
                }
                last.name = name;
              }
              auto it = last.mismatch.find(name);
              if (it != last.mismatch.end()) st.SetLabel(it->second);
              const Call& call = last.call;
              for (auto _ : st) call(t);
              st.SetBytesProcessed(st.iterations() * bytes);
            }));
    }
}

void register_all(bool peers) {
  if (peers) register_peers();
  for (const PairCase& c : pair_cases())
    for (int t : kThreads)
      benchmark::RegisterBenchmark(pair_name(c, t).c_str(),
                                   [c, t](benchmark::State& st) { pair_bench(st, c, t); })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
  std::set<std::pair<int64_t, int>> limits;
  for (const Case& c : cases()) {
    for (int t : kThreads) {
      clock(t, benchmark::RegisterBenchmark(case_name(c, t).c_str(), [c, t](benchmark::State& st) {
              const Call call = c.make();
              call(t);  // warm-up: first touch of the output pages
              for (auto _ : st) call(t);
              st.SetBytesProcessed(st.iterations() * c.bytes);
            }));
      for (int64_t bytes : {c.bytes, c.moved}) {
        if (!limits.insert({bytes, t}).second) continue;
        for (bool s : {false, true})
          clock(t, benchmark::RegisterBenchmark(
                       limit_name(s ? "stream" : "memcpy", bytes, t).c_str(),
                       [bytes, t, s](benchmark::State& st) { copy_bench(st, bytes, t, s); }));
      }
    }
  }
}

// Keeps each benchmark's median bytes/s (and a mode pair's median counters) while the console
// reporter prints as usual.
class Collect : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> gbps;
  std::map<std::string, std::map<std::string, double>> pairs;
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      const bool median = r.aggregate_name == "median";
      std::string name = r.run_name.str();
      const std::string suffix = "/real_time";  // added by UseRealTime()
      if (name.size() > suffix.size() &&
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
        name.resize(name.size() - suffix.size());
      if (r.counters.count("exact_over_robust")) {
        if (median || (r.aggregate_name.empty() && !pairs.count(name)))
          for (const auto& [k, v] : r.counters) pairs[name][k] = v.value;
        continue;
      }
      auto it = r.counters.find("bytes_per_second");
      if (it == r.counters.end()) continue;
      if (median || (r.aggregate_name.empty() && !gbps.count(name)))
        gbps[name] = it->second.value / 1e9;
    }
    ConsoleReporter::ReportRuns(runs);
  }
};

double get(const std::map<std::string, double>& m, const std::string& k) {
  auto it = m.find(k);
  return it == m.end() ? 0 : it->second;
}

double limit(const std::map<std::string, double>& m, int64_t bytes, int t) {
  return std::max(get(m, limit_name("memcpy", bytes, t)), get(m, limit_name("stream", bytes, t)));
}

void print_table(const std::map<std::string, double>& m) {
  std::printf("\n%-10s %-9s %-11s %3s %7s %7s %7s %6s %7s %7s %6s %6s\n", "op", "pass", "shape",
              "thr", "GB/s", "memcpy", "stream", "ratio", "op2/1", "copy2/1", "moved", "ratio");
  for (const Case& c : cases()) {
    for (int t : kThreads) {
      const double g = get(m, case_name(c, t));
      if (g == 0) continue;  // filtered out
      const double lim = limit(m, c.bytes, t);
      const double g1 = get(m, case_name(c, 1)), l1 = limit(m, c.bytes, 1);
      char op_scale[16] = "", copy_scale[16] = "";
      if (t > 1 && g1 > 0) std::snprintf(op_scale, sizeof op_scale, "%.2fx", g / g1);
      if (t > 1 && l1 > 0) std::snprintf(copy_scale, sizeof copy_scale, "%.2fx", lim / l1);
      // Over the bytes really moved: the op's GB/s scaled by moved / bytes, against the limit
      // measured for that many bytes.
      char moved[16] = "", moved_ratio[16] = "";
      if (c.moved != c.bytes) {
        const double f = static_cast<double>(c.moved) / static_cast<double>(c.bytes);
        const double lm = limit(m, c.moved, t);
        std::snprintf(moved, sizeof moved, "%.2fx", f);
        if (lm > 0) std::snprintf(moved_ratio, sizeof moved_ratio, "%.0f%%", 100 * g * f / lm);
      }
      std::printf("%-10s %-9s %-11s %3d %7.1f %7.1f %7.1f %5.0f%% %7s %7s %6s %6s\n",
                  c.op.c_str(), c.pass.c_str(), c.shape.c_str(), t, g,
                  get(m, limit_name("memcpy", c.bytes, t)), get(m, limit_name("stream", c.bytes, t)),
                  lim > 0 ? 100 * g / lim : 0.0, op_scale, copy_scale, moved, moved_ratio);
    }
  }
  std::printf(
      "GB/s: median over repetitions, bytes = the op's minimum traffic; 1 thread by its "
      "CPU time, 2 threads by wall time.\nratio = op / max(memcpy, stream) over the same "
      "bytes at the same threads (the memory limit).\n"
      "op2/1, copy2/1: 2 threads over 1 for the op and for the memory limit.\n"
      "moved: the bytes the op really moves over its minimum (SyncBatchNorm reads x, and dy, "
      "again after the collective); ratio: over those bytes, to the limit for as many bytes.\n");
}

void print_pairs(const std::map<std::string, std::map<std::string, double>>& m) {
  if (m.empty()) return;
  std::printf("\n%-10s %-9s %-11s %3s %7s %7s %7s %12s %12s %6s\n", "op", "pass", "shape", "thr",
              "robust", "exact", "exact/", "payload B/call", "exact", "x");
  std::printf("%-10s %-9s %-11s %3s %7s %7s %7s %12s %12s %6s\n", "", "", "", "", "GB/s", "GB/s",
              "robust", "robust", "", "");
  for (const PairCase& c : pair_cases()) {
    for (int t : kThreads) {
      auto it = m.find(pair_name(c, t));
      if (it == m.end()) continue;  // filtered out
      std::map<std::string, double> v = it->second;
      std::printf("%-10s %-9s %-11s %3d %7.1f %7.1f %6.0f%% %12.0f %12.0f %5.1fx\n", c.op.c_str(),
                  c.pass.c_str(), c.shape.c_str(), t, v["robust_GBps"], v["exact_GBps"],
                  100 * v["exact_over_robust"], v["robust_B"], v["exact_B"],
                  v["robust_B"] > 0 ? v["exact_B"] / v["robust_B"] : 0.0);
    }
  }
  std::printf(
      "Stats::kExact against Stats::kRobust: both modes of the op called alternately in one "
      "benchmark, each call timed (1 thread: CPU time, 2: wall).\nGB/s: median over the calls; "
      "exact/robust: median over the pairs of t_robust / t_exact; both then the median over "
      "repetitions.\npayload B/call: the bytes the op's collective carries (its communicator's "
      "counter), x = exact / robust.\n");
}

}  // namespace

void add_peer(const std::string& lib, const Problem& p, std::function<PeerCall(int)> make) {
  peer_cases().push_back({lib, p, std::move(make)});
}

void add_op(const std::string& op, const std::string& pass, const std::string& shape, int64_t bytes,
            std::function<Call()> make, int64_t moved) {
  cases().push_back({op, pass, shape, bytes, std::move(make), moved > 0 ? moved : bytes});
}

void add_mode_pair(const std::string& op, const std::string& pass, const std::string& shape,
                   int64_t bytes, std::function<ModePair()> make) {
  pair_cases().push_back({op, pass, shape, bytes, std::move(make)});
}

}  // namespace tpnorm_perf

int main(int argc, char** argv) {
  int rc = 0;
  if (tpnorm_perf::peers_command(argc, argv, rc)) return rc;
  // --peers: the peers' benchmarks too ("peer/LIB/..."; bench/cpu/peers.py passes it).
  bool peers = false;
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--peers") == 0) {
      peers = true;
      for (int j = i; j < argc; ++j) argv[j] = argv[j + 1];
      --argc;
      break;
    }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  tpnorm_perf::register_all(peers);
  tpnorm_perf::Collect rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  tpnorm_perf::print_table(rep.gbps);
  tpnorm_perf::print_pairs(rep.pairs);
  benchmark::Shutdown();
  return 0;
}
