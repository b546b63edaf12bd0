// Size-checked sums (Communicator::size_checked_sum_bytes): on MPI a small sum is an exchange
// whose contributions say their own length, so ranks that pass different counts get
// kMismatch on every rank — with several sums in flight, pieces of every size, waited in any
// order — and the sums after it are right (no message of the bad sum is left to be taken by
// a later one).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "expect_error.h"
#include "harness.h"
#include "tpnorm/communicator.h"
#include "tpnorm/error.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

std::vector<double> ramp(size_t n, double k) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = (world_rank() + 1) * static_cast<double>(i + 1) + k;
  return v;
}
double ramp_sum(size_t i, double k) {
  const int P = world_size();
  return P * (P + 1) / 2.0 * static_cast<double>(i + 1) + P * k;
}
int64_t wrong(const std::vector<double>& v, double k) {
  int64_t w = 0;
  for (size_t i = 0; i < v.size(); ++i) w += v[i] != ramp_sum(i, k);
  return w;
}

TEST(CommSizeCheck, TheLimitIsTheExchangeOfSmallSums) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  const size_t want = world_size() > 1 ? (size_t{64} << 10) / (world_size() - 1) : SIZE_MAX;
  EXPECT_EQ(comm->size_checked_sum_bytes(), want);
  EXPECT_EQ(make_single_communicator()->size_checked_sum_bytes(), SIZE_MAX);
}

TEST(CommSizeCheck, DifferentCountsThrowMismatchOnEveryRankAndTheNextSumsAreRight) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  const size_t limit = comm->size_checked_sum_bytes() / sizeof(double);
  // Counts of one piece and of several (2 KiB pieces: 256 doubles), the last rank off by one
  // row of values or by several pieces.
  for (const size_t n : {size_t{5}, size_t{300}, limit - 1}) {
    SCOPED_TRACE("count " + std::to_string(n));
    const bool odd = world_rank() == world_size() - 1;
    const size_t mine = odd ? (n > 300 ? n / 3 : n + 1) : n;
    std::vector<double> before = ramp(700, 1), bad = ramp(mine, 2), after = ramp(n, 3);
    Communicator::Request a = comm->start_all_reduce_sum(before.data(), before.size(), DType::F64);
    Communicator::Request b = comm->start_all_reduce_sum(bad.data(), bad.size(), DType::F64);
    Communicator::Request c = comm->start_all_reduce_sum(after.data(), after.size(), DType::F64);
    // Waited out of order: the bad sum last.
    comm->wait(c);
    comm->wait(a);
    const std::string msg = error_of([&] { comm->wait(b); }, ErrorCode::kMismatch);
    EXPECT_NE(msg.find("disagree on the size of a sum"), std::string::npos) << msg;
    EXPECT_EQ(sum_over_ranks(wrong(before, 1)), 0);
    EXPECT_EQ(sum_over_ranks(wrong(after, 3)), 0);
    EXPECT_EQ(comm->in_flight(), 0u);
    std::vector<double> next = ramp(n, 4);
    comm->all_reduce_sum(next.data(), next.size(), DType::F64);
    EXPECT_EQ(sum_over_ranks(wrong(next, 4)), 0) << "a message of the bad sum was taken later";
  }
}

}  // namespace
