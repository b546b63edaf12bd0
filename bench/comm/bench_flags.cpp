// bench_flags.cpp — see bench_flags.h.
#include "bench_flags.h"

#include <cstdlib>
#include <sstream>

#include "bench_usage.h"  // kBenchUsage: usage.txt, generated at configure time
#include "strategies.h"

namespace tpnorm_bench {
namespace {

bool to_int(const std::string& s, long long& v) {
  char* end = nullptr;
  v = std::strtoll(s.c_str(), &end, 10);
  return !s.empty() && *end == '\0';
}

// Every name is a strategy, and all of one family ("all": the LayerNorm ones, "qk": the
// QK-norm ones, "gated": the gated RMSNorm's).
bool known_strategies(const std::string& list, std::string& error) {
  if (list == "all" || list == "qk" || list == "gated") return true;
  std::stringstream in(list);
  std::string family;
  for (std::string name; std::getline(in, name, ',');) {
    const BenchStrategy* found = nullptr;
    for (const BenchStrategy& s : bench_strategies())
      if (name == s.name) found = &s;
    if (!found) {
      error = "--strategies: unknown strategy '" + name + "'";
      return false;
    }
    if (!family.empty() && family != found->family) {
      error = "--strategies: " + name + " (" + found->family +
              ") compares with strategies of "
              "its own family, not " +
              family + " ones";
      return false;
    }
    family = found->family;
  }
  return true;
}

}  // namespace

void print_help(std::FILE* out) {
  std::fputs(
      "usage: tpnorm_bench [FLAGS]\n"
      "  (run under mpirun; ./launch/tpnorm bench runs one job per world size, see "
      "docs/benchmark.md)\n",
      out);
  std::fputs(kBenchUsage, out);
}

bool parse_flags(int argc, char** argv, Flags& f, std::string& error) {
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    std::string v;
    auto val = [&]() {
      if (i + 1 >= argc) {
        error = "missing value after " + k;
        return false;
      }
      v = argv[++i];
      return true;
    };
    auto number = [&](long long lo, long long& out) {
      if (!val()) return false;
      if (!to_int(v, out) || out < lo) {
        error = k + " needs an integer >= " + std::to_string(lo) + ", not '" + v + "'";
        return false;
      }
      return true;
    };
    long long n = 0;
    if (k == "-h" || k == "--help") {
      f.help = true;
    } else if (k == "--op") {
      if (!val()) return false;
      f.op = v;
    } else if (k == "--strategies") {
      if (!val()) return false;
      if (!known_strategies(v, error)) return false;
      f.strategies = v;
    } else if (k == "--rows" || k == "--hidden" || k == "--kv-hidden" || k == "-n" || k == "-w") {
      if (!number(k == "-w" ? 0 : 1, n)) return false;
      if (k == "--rows") f.cfg.rows = n;
      if (k == "--hidden") f.cfg.hidden = n;
      if (k == "--kv-hidden") f.cfg.kv_hidden = n;
      if (k == "-n") f.iters = static_cast<int>(n);
      if (k == "-w") f.warmup = static_cast<int>(n);
    } else if (k == "--shape") {
      if (!val()) return false;
      f.cfg.shape.clear();
      std::stringstream in(v);
      for (std::string d; std::getline(in, d, ',');) {
        if (!to_int(d, n) || n < 0) {
          error = "--shape needs N,C[,spatial...] of integers >= 0, not '" + v + "'";
          return false;
        }
        f.cfg.shape.push_back(n);
      }
      if (f.cfg.shape.size() < 2 || f.cfg.shape.size() > 8 || f.cfg.shape[1] < 1) {
        error = "--shape must be N,C[,spatial...] with C >= 1 and at most 8 dims";
        return false;
      }
    } else if (k == "--dtype") {
      if (!val()) return false;
      if (v == "fp32")
        f.cfg.dtype = tpnorm::DType::F32;
      else if (v == "fp16")
        f.cfg.dtype = tpnorm::DType::F16;
      else if (v == "bf16")
        f.cfg.dtype = tpnorm::DType::BF16;
      else {
        error = "--dtype must be fp32, fp16 or bf16, not '" + v + "'";
        return false;
      }
    } else if (k == "--stats") {
      if (!val()) return false;
      if (v != "robust" && v != "naive" && v != "exact") {
        error = "--stats must be robust, naive or exact, not '" + v + "'";
        return false;
      }
      f.cfg.stats = v == "naive"   ? tpnorm::Stats::kNaive
                    : v == "exact" ? tpnorm::Stats::kExact
                                   : tpnorm::Stats::kRobust;
    } else if (k == "--csv" || k == "--json" || k == "--proj" || k == "--plotdata") {
      if (!val()) return false;
      (k == "--csv" ? f.csv : k == "--json" ? f.json : k == "--proj" ? f.proj : f.plotdata) = v;
    } else if (k == "--host-beta") {
      if (!val()) return false;
      char* end = nullptr;
      f.host_beta_ns = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !(f.host_beta_ns >= 0)) {
        error = "--host-beta needs ns per byte >= 0, not '" + v + "'";
        return false;
      }
    } else if (k == "--header") {
      f.header = true;
    } else if (k == "--project") {
      f.project = true;
    } else if (k == "--no-check") {
      f.check = false;
    } else if (k == "--progress") {
      f.progress = true;
    } else if (k == "--check-flags") {
      f.check_flags = true;
    } else {
      error = "unknown flag " + k;
      return false;
    }
  }
  if (f.op != "all" && f.op != "layernorm" && f.op != "rmsnorm" && f.op != "syncbn" &&
      f.op != "rmsnormgated") {
    error = "--op must be layernorm, rmsnorm, syncbn, rmsnormgated or all, not '" + f.op + "'";
    return false;
  }
  if (!f.strategies.empty() &&
      (f.cfg.dtype != tpnorm::DType::F32 || f.cfg.stats != tpnorm::Stats::kRobust)) {
    error = "--strategies runs fp32 with robust statistics only (drop --dtype / --stats)";
    return false;
  }
  return true;
}

}  // namespace tpnorm_bench
