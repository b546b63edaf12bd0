// property_driver.h — the driver of the random-case property tests (tests/reliability): many
// small cases at world sizes 1..W on sub-communicators of one W-rank job. Each round splits the
// job's ranks into random contiguous groups (4, 3+1, 2+2, 1+2+1, ...) and every group runs its
// own case at the same time, so that no rank idles (idle ranks spinning in the next collective
// slow an oversubscribed job several times over). All draws come from one seed every rank
// shares; a failing case is printed with its seed for replay.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>

#include "tpnorm/communicator.h"

namespace tpnorm_test {

/// One drawn case: its op (for the per-op tally), a readable description, and how to run it on
/// this rank (a member of the case's communicator). run returns this rank's wrong elements.
struct PropertyCase {
  std::string op, what;
  std::function<int64_t(tpnorm::Communicator& comm, uint64_t seed)> run;
};

/// Draws a case for P ranks from g (which every rank advances identically).
using CaseDrawer = std::function<PropertyCase(std::mt19937_64& g, int P)>;

/// A uniform integer in [0, n).
int pick(std::mt19937_64& g, int n);

/// Runs `cases` drawn cases over MPI_COMM_WORLD's sub-communicators, EXPECTs that no case has a
/// wrong element on any rank, and prints on rank 0 the cases per world size and per op.
void run_random_cases(int cases, uint64_t seed, const CaseDrawer& draw);

}  // namespace tpnorm_test
