// projection.cpp — see projection.h.
#include "projection.h"

#include <cstdio>

namespace tpnorm_bench {

void project(const std::vector<Projected>& items, const Fits& fits, int fitted_at,
             const std::string& csv) {
  struct Model {
    std::string name;
    Topology ar, ag;
  };
  std::vector<Model> models;
  if (fitted_at > 1) models.push_back({"fitted", fits.ar(), fits.ag()});
  for (const Topology& t : topology_presets()) models.push_back({t.name, t, t});
  const struct {
    const char* name;
    Algo algo;
  } algos[] = {{"ring", Algo::kRing}, {"tree", Algo::kTree}, {"best", Algo::kBest}};

  std::FILE* out = csv.empty() ? nullptr : std::fopen(csv.c_str(), "w");
  if (out) std::fprintf(out, "name,topology,algo,world,comm_us\n");
  std::printf(
      "# projected communication time per step (us; all-reduces the faster of ring and "
      "tree, all-gathers ring; fitted = flat with this job's alpha/beta; h100x8 = nodes "
      "of 8 on NVLink 4 + one NDR port per GPU; ndr_flat = every rank its own node):\n");
  for (const Projected& item : items) {
    for (const Model& m : models) {
      std::printf("#   %-13s %-8s", item.name.c_str(), m.name.c_str());
      for (const auto& a : algos) {
        for (int P = 2; P <= 1024; P *= 2) {
          const double t = plan_seconds(item.plan(P, true), P, m.ar, m.ag, a.algo) +
                           plan_seconds(item.plan(P, false), P, m.ar, m.ag, a.algo);
          if (out)
            std::fprintf(out, "%s,%s,%s,%d,%.4f\n", item.name.c_str(), m.name.c_str(), a.name, P,
                         t * 1e6);
          if (a.algo == Algo::kBest && (P == 8 || P == 64 || P == 1024))
            std::printf(" P%d=%.1f", P, t * 1e6);
        }
      }
      std::printf("\n");
    }
  }
  if (out) std::fclose(out);
}

void write_plotdata(const std::string& path, const std::string& name, const std::string& label,
                    int P, const Series& total) {
  if (path.empty()) return;
  std::FILE* out = open_append(path);
  std::fprintf(out, "%s|%s|%d|%.4f|%.4f\n", name.c_str(), label.c_str(), P, total.at(0.5) * 1e6,
               total.at(0) * 1e6);
  std::fclose(out);
}

}  // namespace tpnorm_bench
