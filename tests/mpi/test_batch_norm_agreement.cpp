// SyncBatchNorm failures are the same tpnorm::Error on every rank, with outputs and running
// statistics untouched: a global count of 1 (only one rank holds data), and ranks that
// disagree on the number of channels. Every rank reaches every collective; asserts come after.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "harness.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

// Returns the error text (empty when the call succeeded); y / rm / rv must stay as they were.
std::string train(Communicator& comm, int64_t n, int64_t c, int64_t& wrong) {
  std::vector<float> x(n * c, 2.f), y(n * c, 9.f), rm(c, 3.f), rv(c, 4.f);
  std::string what;
  try {
    sync_batch_norm_forward(comm, view(x.data(), {n, c}), {}, {}, view(rm.data(), {c}),
                            view(rv.data(), {c}), nullptr, view(y.data(), {n, c}), {}, {});
  } catch (const Error& e) {
    what = e.what();
  }
  for (int64_t i = 0; i < n * c; ++i) wrong += y[i] != 9.f;
  for (int64_t i = 0; i < c; ++i) wrong += (rm[i] != 3.f) + (rv[i] != 4.f);
  return what;
}

// The same non-empty text on every rank (compared through its length and a checksum).
int64_t same_error_everywhere(const std::string& what) {
  uint64_t h = 0;  // unsigned: wraps without UB; 40 bits keep P * sum exact in int64
  for (char ch : what) h = h * 31 + static_cast<unsigned char>(ch);
  const int64_t sum = static_cast<int64_t>(h & ((uint64_t{1} << 40) - 1));
  const int64_t p = world_size();
  const int64_t bad_sum = sum_over_ranks(sum) != p * sum;
  const int64_t bad_len =
      sum_over_ranks(static_cast<int64_t>(what.size())) != p * static_cast<int64_t>(what.size());
  return (what.empty() ? 1 : 0) + bad_sum + bad_len;
}

TEST(BatchNormAgreement, GlobalCountOfOneFailsOnEveryRank) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  int64_t wrong = 0;
  const std::string what = train(*comm, world_rank() == 0 ? 1 : 0, 3, wrong);
  wrong += same_error_everywhere(what);
  if (what.find("more than 1 value per channel") == std::string::npos) ++wrong;
  EXPECT_EQ(sum_over_ranks(wrong), 0) << what;
}

TEST(BatchNormAgreement, ChannelMismatchFailsOnEveryRank) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  int64_t wrong = 0;
  const std::string what = train(*comm, 2, world_rank() == 1 ? 4 : 3, wrong);
  wrong += same_error_everywhere(what);
  if (what.find("channels") == std::string::npos) ++wrong;
  EXPECT_EQ(sum_over_ranks(wrong), 0) << what;
  // The communicator stays usable: a good call afterwards succeeds everywhere.
  EXPECT_EQ(sum_over_ranks(train(*comm, 2, 3, wrong).empty() ? 0 : 1), 0);
}

}  // namespace
