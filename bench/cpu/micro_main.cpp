// micro_main.cpp — the harness behind micro.h: registration, the memory limit, and the table.
//
// The memory limit for a case is the faster of memcpy and the streaming-store copy
// (stream_copy.h) moving the same bytes (half read, half written) with the same
// thread count, measured in the same run. The table uses each benchmark's median over the
// repetitions (--benchmark_repetitions), or its only run without repetitions.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "micro.h"
#include "stream_copy.h"

namespace tpnorm_perf {
namespace {

struct Case {
  std::string op, pass, shape;
  int64_t bytes;
  std::function<Call()> make;
};
std::vector<Case>& cases() {
  static std::vector<Case> c;
  return c;
}

constexpr int kThreads[] = {1, 2};

std::string case_name(const Case& c, int t) {
  return c.op + "/" + c.pass + "/" + c.shape + "/threads:" + std::to_string(t);
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

void register_all() {
  std::set<std::pair<int64_t, int>> limits;
  for (const Case& c : cases()) {
    for (int t : kThreads) {
      clock(t, benchmark::RegisterBenchmark(case_name(c, t).c_str(), [c, t](benchmark::State& st) {
              const Call call = c.make();
              call(t);  // warm-up: first touch of the output pages
              for (auto _ : st) call(t);
              st.SetBytesProcessed(st.iterations() * c.bytes);
            }));
      if (!limits.insert({c.bytes, t}).second) continue;
      for (bool s : {false, true})
        clock(t, benchmark::RegisterBenchmark(
                     limit_name(s ? "stream" : "memcpy", c.bytes, t).c_str(),
                     [b = c.bytes, t, s](benchmark::State& st) { copy_bench(st, b, t, s); }));
    }
  }
}

// Keeps each benchmark's median bytes/s while the console reporter prints as usual.
class Collect : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> gbps;
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      const bool median = r.aggregate_name == "median";
      std::string name = r.run_name.str();
      const std::string suffix = "/real_time";  // added by UseRealTime()
      if (name.size() > suffix.size() &&
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
        name.resize(name.size() - suffix.size());
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
  std::printf("\n%-10s %-9s %-11s %3s %7s %7s %7s %6s %7s %7s\n", "op", "pass", "shape", "thr",
              "GB/s", "memcpy", "stream", "ratio", "op2/1", "copy2/1");
  for (const Case& c : cases()) {
    for (int t : kThreads) {
      const double g = get(m, case_name(c, t));
      if (g == 0) continue;  // filtered out
      const double lim = limit(m, c.bytes, t);
      const double g1 = get(m, case_name(c, 1)), l1 = limit(m, c.bytes, 1);
      char op_scale[16] = "", copy_scale[16] = "";
      if (t > 1 && g1 > 0) std::snprintf(op_scale, sizeof op_scale, "%.2fx", g / g1);
      if (t > 1 && l1 > 0) std::snprintf(copy_scale, sizeof copy_scale, "%.2fx", lim / l1);
      std::printf("%-10s %-9s %-11s %3d %7.1f %7.1f %7.1f %5.0f%% %7s %7s\n", c.op.c_str(),
                  c.pass.c_str(), c.shape.c_str(), t, g, get(m, limit_name("memcpy", c.bytes, t)),
                  get(m, limit_name("stream", c.bytes, t)), lim > 0 ? 100 * g / lim : 0.0, op_scale,
                  copy_scale);
    }
  }
  std::printf(
      "GB/s: median over repetitions, bytes = the op's minimum traffic; 1 thread by its "
      "CPU time, 2 threads by wall time.\nratio = op / max(memcpy, stream) over the same "
      "bytes at the same threads (the memory limit).\n"
      "op2/1, copy2/1: 2 threads over 1 for the op and for the memory limit.\n");
}

}  // namespace

void add_op(const std::string& op, const std::string& pass, const std::string& shape, int64_t bytes,
            std::function<Call()> make) {
  cases().push_back({op, pass, shape, bytes, std::move(make)});
}

}  // namespace tpnorm_perf

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  tpnorm_perf::register_all();
  tpnorm_perf::Collect rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  tpnorm_perf::print_table(rep.gbps);
  benchmark::Shutdown();
  return 0;
}
