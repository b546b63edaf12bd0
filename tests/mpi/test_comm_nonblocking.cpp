// The Communicator's non-blocking sum: several sums in flight, started in the same order on
// every rank and waited in any order, give the same sums as the blocking call; counters count
// each sum once, at start; the single-process communicator's default path works the same way.
#include <gtest/gtest.h>

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "harness.h"
#include "tpnorm/communicator.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

// Rank r contributes (r + 1) * (i + 1) + k at element i of buffer k: the sum is exact in
// float32 and float64, and wrong if buffers or elements are mixed up.
template <class T>
std::vector<T> contribution(size_t n, int k) {
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = static_cast<T>((world_rank() + 1) * static_cast<double>(i + 1) + k);
  return v;
}
double expected(size_t i, int k) {
  const int P = world_size();
  return P * (P + 1) / 2.0 * static_cast<double>(i + 1) + P * k;
}

TEST(CommNonBlocking, SumsInFlightWaitedInReverseOrder) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  const std::vector<size_t> sizes = {1, 17, 4096, 0, 300};
  std::vector<std::vector<double>> bufs;
  std::vector<std::vector<float>> fbufs;
  std::vector<Communicator::Request> reqs;
  for (size_t k = 0; k < sizes.size(); ++k) {
    bufs.push_back(contribution<double>(sizes[k], static_cast<int>(k)));
    fbufs.push_back(contribution<float>(sizes[k], static_cast<int>(k)));
  }
  // Interleave float64 and float32 sums: ten in flight at once.
  for (size_t k = 0; k < sizes.size(); ++k) {
    reqs.push_back(comm->start_all_reduce_sum(bufs[k].data(), sizes[k], DType::F64));
    reqs.push_back(comm->start_all_reduce_sum(fbufs[k].data(), sizes[k], DType::F32));
  }
  EXPECT_EQ(comm->counters().calls, 2 * sizes.size());   // counted at start, empty ones too
  EXPECT_EQ(comm->in_flight(), 2 * (sizes.size() - 1));  // count 0 starts nothing
  for (size_t k = reqs.size(); k-- > 0;) comm->wait(reqs[k]);
  EXPECT_EQ(comm->in_flight(), 0u);
  int64_t wrong = 0;
  for (size_t k = 0; k < sizes.size(); ++k)
    for (size_t i = 0; i < sizes[k]; ++i) {
      wrong += bufs[k][i] != expected(i, static_cast<int>(k));
      wrong += fbufs[k][i] != static_cast<float>(expected(i, static_cast<int>(k)));
    }
  EXPECT_EQ(wrong, 0);
  uint64_t bytes = 0;
  for (size_t n : sizes) bytes += n * (8 + 4);
  EXPECT_EQ(comm->counters().bytes_sent, bytes);
  for (auto& r : reqs) EXPECT_EQ(r.id, 0u);
  comm->wait(reqs[0]);  // waiting twice does nothing
}

// One sum, one ticket: a Request moves (the source is left with id 0) and cannot be copied, so
// the same sum cannot be waited through two copies (that counted it out of in_flight() twice,
// which then wrapped round).
static_assert(!std::is_copy_constructible_v<Communicator::Request>);
static_assert(!std::is_copy_assignable_v<Communicator::Request>);
static_assert(std::is_nothrow_move_constructible_v<Communicator::Request>);

TEST(CommNonBlocking, AMovedRequestIsWaitedOnce) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  std::vector<double> a = contribution<double>(100, 5), b = contribution<double>(7, 6);
  Communicator::Request r = comm->start_all_reduce_sum(a.data(), a.size(), DType::F64);
  Communicator::Request s = comm->start_all_reduce_sum(b.data(), b.size(), DType::F64);
  EXPECT_EQ(comm->in_flight(), 2u);
  Communicator::Request moved = std::move(r);
  EXPECT_EQ(r.id, 0u);
  EXPECT_NE(moved.id, 0u);
  comm->wait(r);  // the moved-from ticket: nothing to wait for
  EXPECT_EQ(comm->in_flight(), 2u);
  comm->wait(moved);
  EXPECT_EQ(comm->in_flight(), 1u);
  std::vector<Communicator::Request> kept;
  kept.push_back(std::move(s));
  comm->wait(s);
  EXPECT_EQ(comm->in_flight(), 1u);
  comm->wait(kept[0]);
  comm->wait(kept[0]);
  EXPECT_EQ(comm->in_flight(), 0u);
  int64_t wrong = 0;
  for (size_t i = 0; i < a.size(); ++i) wrong += a[i] != expected(i, 5);
  for (size_t i = 0; i < b.size(); ++i) wrong += b[i] != expected(i, 6);
  EXPECT_EQ(wrong, 0);
}

TEST(CommNonBlocking, BlockingSumsBetweenStartAndWait) {
  // A started sum stays in flight while blocking sums (started after it, on every rank) run.
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  std::vector<double> a = contribution<double>(1000, 1), b = contribution<double>(10, 2);
  auto r = comm->start_all_reduce_sum(a.data(), a.size(), DType::F64);
  comm->all_reduce_sum(b.data(), b.size(), DType::F64);
  comm->wait(r);
  int64_t wrong = 0;
  for (size_t i = 0; i < a.size(); ++i) wrong += a[i] != expected(i, 1);
  for (size_t i = 0; i < b.size(); ++i) wrong += b[i] != expected(i, 2);
  EXPECT_EQ(wrong, 0);
}

TEST(CommNonBlocking, WatchdogOffUsesTheSamePath) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  comm->set_timeout(0);
  std::vector<double> a = contribution<double>(33, 3);
  auto r = comm->start_all_reduce_sum(a.data(), a.size(), DType::F64);
  comm->wait(r);
  int64_t wrong = 0;
  for (size_t i = 0; i < a.size(); ++i) wrong += a[i] != expected(i, 3);
  EXPECT_EQ(wrong, 0);
}

TEST(CommNonBlocking, UnwaitedSumsCompleteWhenTheCommunicatorGoes) {
  // Destroying a communicator with sums in flight completes them (no leak, no hang).
  std::vector<double> a = contribution<double>(64, 4);
  {
    auto comm = make_mpi_communicator(MPI_COMM_WORLD);
    comm->start_all_reduce_sum(a.data(), a.size(), DType::F64);
  }
  int64_t wrong = 0;
  for (size_t i = 0; i < a.size(); ++i) wrong += a[i] != expected(i, 4);
  EXPECT_EQ(wrong, 0);
}

TEST(CommNonBlocking, SingleProcessDefault) {
  auto comm = make_single_communicator();
  std::vector<double> a = {1, 2, 3};
  auto r = comm->start_all_reduce_sum(a.data(), a.size(), DType::F64);
  EXPECT_EQ(comm->in_flight(), 1u);
  comm->wait(r);
  EXPECT_EQ(a, (std::vector<double>{1, 2, 3}));
  EXPECT_EQ(comm->counters().calls, 1u);
  EXPECT_EQ(comm->counters().bytes_sent, 24u);
  EXPECT_EQ(comm->in_flight(), 0u);
}

}  // namespace
