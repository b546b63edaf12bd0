// Agreement on every call, by default: a rank that passes one row fewer on call 30 of a fresh
// MPI communicator (no set_strict_calls, TPNORM_STRICT_CALLS unset) gets the same tpnorm error
// on every rank, instead of payload collectives of different lengths (which ended the job with
// MPI_ERR_TRUNCATE while only the first 16 calls were checked). The communicator still works
// afterwards, and a good call after the bad one gives the right result.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "expect_error.h"
#include "harness.h"
#include "reference.h"
#include "tpnorm/error.h"
#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

TEST(AgreementEveryCall, RowMismatchOnCall30IsTheSameErrorEverywhere) {
  ASSERT_EQ(std::getenv("TPNORM_STRICT_CALLS"), nullptr) << "this test checks the default";
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  const int P = world_size(), me = world_rank();
  const int64_t R = 7, H = 5 * P + 1;  // hidden not divisible by P; a rank may hold 5 or 6
  const Split cols = split_even(H, P);
  const int64_t h = cols.count[me];
  const std::vector<float> X = normal(30, 0, R * H, 3.0);
  const std::vector<float> x = columns(X, R, H, cols.offset[me], h);
  std::vector<float> y(R * h, -7.f), mean(R, -7.f), rstd(R, -7.f);
  auto call = [&](int64_t rows) {
    layer_norm_forward(*comm, view(x.data(), {rows, h}), {}, {}, view(y.data(), {rows, h}),
                       view(mean.data(), {rows}), view(rstd.data(), {rows}));
  };
  for (int i = 1; i < 30; ++i) call(R);
  EXPECT_EQ(comm->sequence(), 29u);

  std::fill(y.begin(), y.end(), -7.f);
  const std::string msg = error_of([&] { call(me == P - 1 ? R - 1 : R); }, ErrorCode::kMismatch);
  EXPECT_NE(msg.find("ranks disagree on 'rows'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank " + std::to_string(P - 1)), std::string::npos) << msg;
  int64_t touched = 0;
  for (float v : y) touched += v != -7.f;
  EXPECT_EQ(touched, 0) << "a failed call wrote its output";

  // The next call agrees again and is right (the communicator was not left half-way).
  call(R);
  const RowRef ref = row_norm_reference(true, X, R, H, {}, {}, 1e-5);
  int64_t wrong = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < h; ++c)
      wrong += std::fabs(y[r * h + c] - ref.y[r * H + cols.offset[me] + c]) > 1e-4;
  EXPECT_EQ(sum_over_ranks(wrong), 0);
}

}  // namespace

namespace {

// How the check travels: a call whose header + payload fit the communicator's size-checked
// sum carries the header inside its ONE sum; a larger call sends the header first, in its own
// sum under the partial. Sizes that differ across the two regimes (one rank small, the others
// large) are the same error everywhere too.
struct RowCall {
  int64_t R, h, H;
  Split cols;
  std::vector<float> X, x, y, mean, rstd;
  RowCall(int64_t rows, uint64_t seed) : R(rows), H(5 * world_size() + 1) {
    cols = split_even(H, world_size());
    h = cols.count[world_rank()];
    X = normal(seed, 0, R * H, 3.0);
    x = columns(X, R, H, cols.offset[world_rank()], h);
    y.assign(R * h, -7.f);
    mean.assign(R, -7.f);
    rstd.assign(R, -7.f);
  }
  void run(Communicator& comm, int64_t rows) {
    layer_norm_forward(comm, view(x.data(), {rows, h}), {}, {}, view(y.data(), {rows, h}),
                       view(mean.data(), {rows}), view(rstd.data(), {rows}));
  }
  int64_t wrong() const {
    const RowRef ref = row_norm_reference(true, X, R, H, {}, {}, 1e-5);
    int64_t w = 0;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < h; ++c)
        w += std::fabs(y[r * h + c] - ref.y[r * H + cols.offset[world_rank()] + c]) > 1e-4;
    return sum_over_ranks(w);
  }
};

TEST(AgreementEveryCall, SmallCallsCheckInsideTheirOneSumLargeOnesFirst) {
  if (world_size() < 2) GTEST_SKIP() << "one rank makes no exchange";
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  const size_t limit = comm->size_checked_sum_bytes();
  // LayerNorm forward sends a 10-value header and 2 doubles per row.
  const int64_t small = 7, large = static_cast<int64_t>(limit / 16) + 8;
  ASSERT_LE((10 + 2 * small) * 8, static_cast<int64_t>(limit));
  ASSERT_GT((10 + 2 * large) * 8, static_cast<int64_t>(limit));
  RowCall s(small, 31), l(large, 32);
  comm->reset_counters();
  s.run(*comm, small);
  EXPECT_EQ(comm->counters().calls, 1u) << "the header rides in the small call's one sum";
  EXPECT_EQ(s.wrong(), 0);
  comm->reset_counters();
  l.run(*comm, large);
  EXPECT_EQ(comm->counters().calls, 2u) << "a large call checks its header first";
  EXPECT_EQ(comm->counters().bytes_sent, static_cast<uint64_t>((10 + 2 * large) * 8));
  EXPECT_EQ(l.wrong(), 0);
}

TEST(AgreementEveryCall, OneRankSmallTheOthersLargeIsTheSameErrorEverywhere) {
  if (world_size() < 2) GTEST_SKIP() << "one rank cannot disagree";
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  const int64_t large = static_cast<int64_t>(comm->size_checked_sum_bytes() / 16) + 8;
  const bool odd = world_rank() == world_size() - 1;
  RowCall l(large, 33);
  for (const bool small_is_odd : {true, false}) {
    SCOPED_TRACE(small_is_odd ? "the last rank small" : "the last rank large");
    const int64_t rows = odd == small_is_odd ? 3 : large;
    std::fill(l.y.begin(), l.y.end(), -7.f);
    const std::string msg = error_of([&] { l.run(*comm, rows); }, ErrorCode::kMismatch);
    EXPECT_NE(msg.find("ranks disagree on 'rows'"), std::string::npos) << msg;
    int64_t touched = 0;
    for (float v : l.y) touched += v != -7.f;
    EXPECT_EQ(touched, 0) << "a failed call wrote its output";
  }
  l.run(*comm, large);  // the communicator is in step again
  EXPECT_EQ(l.wrong(), 0);
}

}  // namespace
