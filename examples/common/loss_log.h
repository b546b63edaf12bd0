// loss_log.h — what the examples share: --flag parsing, seeded data, and the loss log that
// tests/examples compares across world sizes.
//
// An example run at P ranks prints one loss per step (rank 0) and, with --write FILE, saves
// them; with --check FILE it compares against a log written by another run (typically P = 1)
// and fails when any step differs by more than --tol relative to max(1, |reference|). The
// verdict is decided on rank 0 and broadcast, so every rank exits with the same status.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace tpnorm_example {

/// "--key value" pairs; flags without a value are not used by the examples.
struct Flags {
  std::vector<std::string> args;
  Flags(int argc, char** argv) : args(argv + 1, argv + argc) {}
  std::string get(const std::string& key, const std::string& def) const {
    for (size_t i = 0; i + 1 < args.size(); ++i)
      if (args[i] == "--" + key) return args[i + 1];
    return def;
  }
  double num(const std::string& key, double def) const {
    const std::string v = get(key, "");
    return v.empty() ? def : std::atof(v.c_str());
  }
};

/// n values of scale * N(0,1) from `seed`: identical on every rank, whatever the world size.
inline std::vector<double> normal(uint64_t seed, size_t n, double scale = 1.0) {
  std::mt19937_64 g(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(n);
  for (auto& e : v) e = d(g);
  return v;
}

/// [c0, c0+n) of `total` split contiguously over `parts`, the first total % parts get one more.
struct Slice {
  int64_t c0 = 0, n = 0;
};
inline Slice slice_of(int64_t total, int parts, int p) {
  const int64_t base = total / parts, extra = total % parts;
  return {p * base + std::min<int64_t>(p, extra), base + (p < extra ? 1 : 0)};
}

/// Writes / checks the per-step losses (rank 0 decides). Returns the exit status for main.
inline int finish_losses(const Flags& f, const std::vector<double>& losses, int rank) {
  int status = 0;
  if (rank == 0) {
    const std::string out = f.get("write", ""), ref = f.get("check", "");
    if (!out.empty()) {
      std::ofstream o(out);
      o.precision(17);
      for (double l : losses) o << l << '\n';
      if (!o) status = 2;
    }
    if (!ref.empty()) {
      std::ifstream in(ref);
      std::vector<double> want;
      for (double v; in >> v;) want.push_back(v);
      const double tol = f.num("tol", 1e-4);
      double worst = 0;
      if (want.size() != losses.size()) {
        std::printf("loss log %s has %zu steps, this run %zu\n", ref.c_str(), want.size(),
                    losses.size());
        status = 1;
      }
      for (size_t i = 0; i < std::min(want.size(), losses.size()); ++i) {
        const double d = std::fabs(losses[i] - want[i]) / std::max(1.0, std::fabs(want[i]));
        worst = std::isnan(d) ? INFINITY : std::max(worst, d);
      }
      if (!(worst <= tol)) status = 1;
      std::printf("max relative loss difference to %s: %.3g (tolerance %.3g): %s\n", ref.c_str(),
                  worst, tol, status ? "FAILED" : "ok");
    }
  }
  MPI_Bcast(&status, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return status;
}

}  // namespace tpnorm_example
