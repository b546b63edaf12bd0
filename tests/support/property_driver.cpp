// property_driver.cpp — see property_driver.h.
#include "property_driver.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <vector>

#include "harness.h"
#include "tpnorm/mpi.h"

namespace tpnorm_test {
namespace {

// This rank's communicator for a split of the world into contiguous groups of sizes `sizes`;
// made (collectively, on every rank) the first time a split is drawn.
tpnorm::Communicator& group_comm(const std::vector<int>& sizes) {
  static std::map<std::vector<int>, std::unique_ptr<tpnorm::Communicator>> cache;
  auto& c = cache[sizes];
  if (!c) {
    int group = 0;
    for (int end = sizes[0]; world_rank() >= end; end += sizes[++group]) {
    }
    MPI_Comm sub;
    MPI_Comm_split(MPI_COMM_WORLD, group, world_rank(), &sub);
    c = tpnorm::make_mpi_communicator(sub);
    MPI_Comm_free(&sub);  // the communicator keeps its own duplicate
  }
  return *c;
}

}  // namespace

int pick(std::mt19937_64& g, int n) { return static_cast<int>(g() % static_cast<uint64_t>(n)); }

void run_random_cases(int cases, uint64_t seed0, const CaseDrawer& draw) {
  const int W = world_size(), me = world_rank();
  // TPNORM_PROPERTY_SEED / TPNORM_PROPERTY_CASES explore other draws by hand; ctest uses the
  // fixed defaults so a run is reproducible.
  if (const char* s = std::getenv("TPNORM_PROPERTY_SEED")) seed0 = std::strtoull(s, nullptr, 10);
  if (const char* n = std::getenv("TPNORM_PROPERTY_CASES")) cases = std::atoi(n);
  std::mt19937_64 g(seed0);  // the same draws on every rank
  int64_t bad_cases = 0, ran = 0;
  std::vector<int> by_size(W + 1, 0);
  std::map<std::string, int> by_op;  // the same keys on every rank: the draws are shared
  std::map<std::string, double> worst_err, worst_use;  // this rank's largest |got - want| and
                                                       // err / tolerance, per op
  for (int i = 0; i < cases;) {
    std::vector<int> sizes;
    for (int left = W; left > 0; left -= sizes.back()) sizes.push_back(1 + pick(g, left));
    tpnorm::Communicator& comm = group_comm(sizes);
    for (size_t k = 0, first = 0; k < sizes.size(); first += sizes[k++], ++i) {
      const PropertyCase c = draw(g, sizes[k]);
      by_size[sizes[k]] += 1;
      by_op[c.op] += 1;
      const uint64_t seed = seed0 + static_cast<uint64_t>(i);
      if (me < static_cast<int>(first) || me >= static_cast<int>(first) + sizes[k]) continue;
      ++ran;
      reset_max_abs_err();
      const int64_t wrong = c.run(comm, seed);
      worst_err[c.op] = std::max(worst_err[c.op], max_abs_err());
      worst_use[c.op] = std::max(worst_use[c.op], max_tolerance_used());
      if (wrong) {
        ++bad_cases;
        std::fprintf(stderr, "[rank %d] case %d (seed %llu): %s: %lld wrong elements\n", me, i,
                     static_cast<unsigned long long>(seed), c.what.c_str(),
                     static_cast<long long>(wrong));
      }
    }
  }
  EXPECT_EQ(sum_over_ranks(bad_cases), 0);
  if (me == 0) {
    std::printf("property: random cases by world size:");
    for (int P = 1; P <= W; ++P) std::printf(" P=%d: %d", P, by_size[P]);
    std::printf("; rank 0 ran %lld\n", static_cast<long long>(ran));
  }
  for (const auto& [op, n] : by_op) {
    // Collectives: every rank, in the map's (shared) order.
    const double worst = max_over_ranks(worst_err[op]), use = max_over_ranks(worst_use[op]);
    if (me == 0)
      std::printf(
          "property: %-16s %4d cases, largest |got - want| %.3g, worst element at "
          "%.2f of its tolerance\n",
          op.c_str(), n, worst, use);
  }
}

}  // namespace tpnorm_test
