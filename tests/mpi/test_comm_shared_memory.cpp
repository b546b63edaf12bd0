// The MPI communicator's small sums through shared memory (comm/shm_exchange.h), at 2-4 ranks
// on one node; ctest runs this file again with TPNORM_SHM=0 (the point-to-point exchange),
// where the same sums must give the same results and no sum may take shared memory.
// - the path taken: small sums go through shared memory unless TPNORM_SHM=0, large ones never;
// - sums in flight waited in an order that differs by rank, with more in flight than the ring
//   has slots (a start then completes the slot's earlier sum itself), large sums in between;
// - more sums than slots started and dropped: the communicator's destructor completes them;
// - ranks passing different counts: kMismatch with the same text on every rank, also for a sum
//   completed early by a later start (thrown at its own wait), and the sums after it right;
// - fp32 / fp64 / int64 sums bitwise equal to the contributions added in rank order (what the
//   MPI exchange does) and to a communicator made with TPNORM_SHM=0, and near a float64 sum;
// - the progress thread: sums handed to it (progress_in_background) are added while no rank
//   waits, blocking sums never reach it, and waits that race it (each sum added once, by one
//   of them) give the same bits, mismatches included.
// Every communicator here has a 60 s watchdog: a protocol that hangs ends the test, not CI.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "expect_error.h"
#include "harness.h"
#include "tpnorm/communicator.h"
#include "tpnorm/error.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

constexpr int kSlots = 16;  // comm/shm_exchange.h's ring

bool shm_expected() {
  const char* v = std::getenv("TPNORM_SHM");
  return world_size() > 1 && !(v && std::strcmp(v, "0") == 0);
}

std::unique_ptr<Communicator> make_comm() {
  auto c = make_mpi_communicator(MPI_COMM_WORLD);
  c->set_timeout(60);
  return c;
}

// A communicator made with the environment variable `name` set to `value` for the while.
std::unique_ptr<Communicator> make_comm_with(const char* name, const char* value) {
  const char* v = std::getenv(name);
  const std::string saved = v ? v : "";
  setenv(name, value, 1);
  auto c = make_comm();
  if (v)
    setenv(name, saved.c_str(), 1);
  else
    unsetenv(name);
  return c;
}

// A communicator on the point-to-point exchange whatever the environment says.
std::unique_ptr<Communicator> make_message_comm() { return make_comm_with("TPNORM_SHM", "0"); }

// Rank r's value at element i of sum k: not exactly representable sums of mixed magnitudes,
// so the order of the additions shows in the bits.
double value(int r, int k, size_t i) {
  const double u = std::sin(1.0 + 0.37 * r + 0.011 * k + 0.0007 * static_cast<double>(i));
  return u * std::pow(10.0, (r * 3 + k + static_cast<int>(i)) % 7 - 3);
}
template <class T>
T contribution(int r, int k, size_t i) {
  if constexpr (std::is_same_v<T, int64_t>)
    return static_cast<int64_t>(value(r, k, i) * 1e12);
  else
    return static_cast<T>(value(r, k, i));
}
template <class T>
std::vector<T> mine(int k, size_t n) {
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = contribution<T>(world_rank(), k, i);
  return v;
}
// The contributions of ranks 0..P-1 added in that order, in T.
template <class T>
T rank_order_sum(int k, size_t i) {
  T acc = contribution<T>(0, k, i);
  for (int r = 1; r < world_size(); ++r) acc += contribution<T>(r, k, i);
  return acc;
}
// Elements of v that differ from the rank-order sum, on this rank (no collective).
template <class T>
int64_t not_rank_order_local(const std::vector<T>& v, int k) {
  int64_t w = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    const T want = rank_order_sum<T>(k, i);
    w += std::memcmp(&v[i], &want, sizeof(T)) != 0;
  }
  return w;
}
template <class T>
int64_t not_rank_order(const std::vector<T>& v, int k) {
  return sum_over_ranks(not_rank_order_local(v, k));
}

TEST(CommSharedMemory, SmallSumsTakeSharedMemoryUnlessTurnedOff) {
  auto comm = make_comm();
  const size_t limit = comm->size_checked_sum_bytes() / sizeof(double);
  std::vector<double> small = mine<double>(1, 100), edge = mine<double>(2, limit),
                      large = mine<double>(3, world_size() > 1 ? limit + 1 : 10);
  comm->all_reduce_sum(small.data(), small.size(), DType::F64);
  auto r = comm->start_all_reduce_sum(edge.data(), edge.size(), DType::F64);
  comm->wait(r);
  const uint64_t small_ones = mpi_shared_memory_sums(*comm);
  comm->all_reduce_sum(large.data(), large.size(), DType::F64);
  EXPECT_EQ(small_ones, shm_expected() ? 2u : 0u);
  EXPECT_EQ(mpi_shared_memory_sums(*comm), small_ones) << "a large sum took shared memory";
  EXPECT_EQ(mpi_shared_memory_sums(*make_message_comm()), 0u);
  EXPECT_EQ(mpi_shared_memory_sums(*make_single_communicator()), 0u);
  EXPECT_EQ(not_rank_order(small, 1), 0);
  EXPECT_EQ(not_rank_order(edge, 2), 0);
  // A large sum is MPI_Iallreduce, whose order is MPI's: compare with a tolerance.
  int64_t far = 0;
  for (size_t i = 0; i < large.size(); ++i)
    far += std::fabs(large[i] - rank_order_sum<double>(3, i)) > 1e-12;
  EXPECT_EQ(sum_over_ranks(far), 0);
}

TEST(CommSharedMemory, ManyInFlightWaitedInAnOrderThatDiffersByRank) {
  auto comm = make_comm();
  const size_t limit = comm->size_checked_sum_bytes() / sizeof(double);
  // 3 rings' worth, sizes from 1 to the limit, a large (MPI_Iallreduce) sum every 7th.
  const int n = 3 * kSlots + 5;
  std::vector<std::vector<double>> bufs;
  std::vector<Communicator::Request> reqs;
  for (int k = 0; k < n; ++k) {
    const size_t len = k % 7 == 3 && world_size() > 1 ? limit + 5 : 1 + (k * 977u) % limit;
    bufs.push_back(mine<double>(k, len));
  }
  for (int k = 0; k < n; ++k)
    reqs.push_back(comm->start_all_reduce_sum(bufs[k].data(), bufs[k].size(), DType::F64));
  EXPECT_EQ(comm->in_flight(), static_cast<size_t>(n));
  // Rank 0 waits newest first, the others oldest first from a rank-dependent place. An error
  // on one rank only is counted, not thrown past the others' collectives (they would hang).
  int64_t errors = 0;
  for (int j = 0; j < n; ++j) {
    const int k = world_rank() == 0 ? n - 1 - j : (j + 5 * world_rank()) % n;
    try {
      comm->wait(reqs[k]);
    } catch (const Error& e) {
      ADD_FAILURE() << "sum " << k << ": " << e.what();
      ++errors;
    }
  }
  EXPECT_EQ(sum_over_ranks(errors), 0);
  EXPECT_EQ(comm->in_flight(), 0u);
  for (int k = 0; k < n; ++k) {
    SCOPED_TRACE("sum " + std::to_string(k));
    if (bufs[k].size() <= limit) {
      EXPECT_EQ(not_rank_order(bufs[k], k), 0);
    } else {
      int64_t far = 0;
      for (size_t i = 0; i < bufs[k].size(); ++i)
        far += std::fabs(bufs[k][i] - rank_order_sum<double>(k, i)) > 1e-12;
      EXPECT_EQ(sum_over_ranks(far), 0);
    }
  }
  // And the ring goes on: blocking sums after it.
  for (int k = 0; k < kSlots + 3; ++k) {
    std::vector<double> v = mine<double>(100 + k, 33);
    comm->all_reduce_sum(v.data(), v.size(), DType::F64);
    EXPECT_EQ(not_rank_order(v, 100 + k), 0);
  }
}

TEST(CommSharedMemory, MoreSumsThanSlotsDroppedAreCompletedByTheDestructor) {
  const int n = 2 * kSlots + 3;
  std::vector<std::vector<float>> bufs;
  for (int k = 0; k < n; ++k) bufs.push_back(mine<float>(k, 1 + 13 * k));
  {
    auto comm = make_comm();
    for (int k = 0; k < n; ++k)
      comm->start_all_reduce_sum(bufs[k].data(), bufs[k].size(), DType::F32);
    EXPECT_EQ(comm->in_flight(), static_cast<size_t>(n));
  }
  for (int k = 0; k < n; ++k) EXPECT_EQ(not_rank_order(bufs[k], k), 0) << "sum " << k;
}

TEST(CommSharedMemory, DifferentCountsAreTheSameMismatchEverywhereAndTheNextSumsAreRight) {
  if (world_size() < 2) GTEST_SKIP() << "one rank cannot disagree";
  auto comm = make_comm();
  const bool odd = world_rank() == world_size() - 1;
  const size_t limit = comm->size_checked_sum_bytes() / sizeof(double);
  // waited at once, and completed early by the starts of a full ring after it
  for (const bool early : {false, true}) {
    SCOPED_TRACE(early ? "completed early by later starts" : "waited at once");
    std::vector<double> before = mine<double>(1, 40), bad = mine<double>(2, odd ? 9 : limit);
    auto a = comm->start_all_reduce_sum(before.data(), before.size(), DType::F64);
    auto b = comm->start_all_reduce_sum(bad.data(), bad.size(), DType::F64);
    std::vector<std::vector<double>> later;
    std::vector<Communicator::Request> reqs;
    for (int k = 0; k < (early ? kSlots + 2 : 1); ++k) later.push_back(mine<double>(10 + k, 7 + k));
    for (auto& v : later)
      reqs.push_back(comm->start_all_reduce_sum(v.data(), v.size(), DType::F64));
    for (auto& r : reqs) comm->wait(r);  // every later sum is right before the bad one throws
    comm->wait(a);
    const std::string msg = error_of([&] { comm->wait(b); }, ErrorCode::kMismatch);
    std::string want =
        "tpnorm: all_reduce_sum: the ranks disagree on the size of a sum: counts by rank [";
    for (int r = 0; r < world_size(); ++r)
      want += (r ? ", " : "") + std::to_string(r == world_size() - 1 ? 9 : limit);
    EXPECT_EQ(msg, want + "]");
    EXPECT_EQ(not_rank_order(before, 1), 0);
    for (size_t k = 0; k < later.size(); ++k)
      EXPECT_EQ(not_rank_order(later[k], 10 + static_cast<int>(k)), 0);
    EXPECT_EQ(comm->in_flight(), 0u);
    std::vector<double> next = mine<double>(3, limit);
    comm->all_reduce_sum(next.data(), next.size(), DType::F64);
    EXPECT_EQ(not_rank_order(next, 3), 0) << "the sum after the mismatch";
  }
}

template <class T>
void same_bits_as_the_exchange(DType dt) {
  auto shm = make_comm();
  auto msg = make_message_comm();
  const size_t limit = shm->size_checked_sum_bytes() / sizeof(T);
  for (const size_t n : {size_t{1}, size_t{3}, size_t{255}, size_t{1000}, limit}) {
    SCOPED_TRACE("count " + std::to_string(n));
    const int k = static_cast<int>(n % 50);
    std::vector<T> a = mine<T>(k, n), b = a;
    auto r = shm->start_all_reduce_sum(a.data(), n, dt);
    msg->all_reduce_sum(b.data(), n, dt);
    shm->wait(r);
    int64_t differ = 0, far = 0;
    for (size_t i = 0; i < n; ++i) {
      differ += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
      double ref = 0, mag = 0;  // float64 reference of the values as T holds them
      for (int q = 0; q < world_size(); ++q) {
        ref += static_cast<double>(contribution<T>(q, k, i));
        mag += std::fabs(static_cast<double>(contribution<T>(q, k, i)));
      }
      // P - 1 roundings of partial sums at most |terms| each (int64: exact)
      const double tol = std::is_same_v<T, float>    ? 1e-6 * mag
                         : std::is_same_v<T, double> ? 1e-15 * mag
                                                     : 0.0;
      far += std::fabs(static_cast<double>(a[i]) - ref) > tol;
    }
    EXPECT_EQ(sum_over_ranks(differ), 0) << "shared memory and the exchange differ";
    EXPECT_EQ(not_rank_order(a, k), 0);
    EXPECT_EQ(sum_over_ranks(far), 0);
  }
}

TEST(CommSharedMemory, Fp32SameBitsAsTheExchange) { same_bits_as_the_exchange<float>(DType::F32); }
TEST(CommSharedMemory, Fp64SameBitsAsTheExchange) { same_bits_as_the_exchange<double>(DType::F64); }
TEST(CommSharedMemory, Int64SameBitsAsTheExchange) {
  same_bits_as_the_exchange<int64_t>(DType::I64);
}

// Polls until the progress thread has added `want` sums (it runs on its own; a loaded machine
// only delays it), at most 60 s.
uint64_t background_sums_reaching(const Communicator& comm, uint64_t want) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (mpi_background_sums(comm) < want && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return mpi_background_sums(comm);
}

TEST(CommSharedMemory, HandedOverSumsAreAddedWhileNoRankWaits) {
  auto comm = make_comm();
  const size_t limit = comm->size_checked_sum_bytes() / sizeof(double);
  const int n = kSlots + 4;  // more than a ring: the thread's reads free the slots
  std::vector<std::vector<double>> bufs;
  std::vector<Communicator::Request> reqs;
  for (int k = 0; k < n; ++k) bufs.push_back(mine<double>(k, 1 + (k * 613u) % limit));
  for (int k = 0; k < kSlots; ++k)
    reqs.push_back(comm->start_all_reduce_sum(bufs[k].data(), bufs[k].size(), DType::F64));
  comm->progress_in_background();
  const uint64_t want = shm_expected() ? kSlots : 0;
  EXPECT_EQ(background_sums_reaching(*comm, want), want);
  // Every slot was read by the peers' threads: these starts reuse them without any wait.
  for (int k = kSlots; k < n; ++k)
    reqs.push_back(comm->start_all_reduce_sum(bufs[k].data(), bufs[k].size(), DType::F64));
  comm->progress_in_background();
  EXPECT_EQ(background_sums_reaching(*comm, shm_expected() ? n : 0), shm_expected() ? n : 0);
  for (int j = 0; j < n; ++j) comm->wait(reqs[(j + 3 * world_rank()) % n]);
  for (int k = 0; k < n; ++k) EXPECT_EQ(not_rank_order(bufs[k], k), 0) << "sum " << k;
  // Blocking sums and sums waited without the hand-over are the waits' own.
  const uint64_t before = mpi_background_sums(*comm);
  std::vector<double> v = mine<double>(7, 100), w = mine<double>(8, 3);
  comm->all_reduce_sum(v.data(), v.size(), DType::F64);
  auto r = comm->start_all_reduce_sum(w.data(), w.size(), DType::F64);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  comm->wait(r);
  EXPECT_EQ(mpi_background_sums(*comm), before);
  EXPECT_EQ(not_rank_order(v, 7), 0);
  EXPECT_EQ(not_rank_order(w, 8), 0);
}

// The thread and the waits race for each sum (claimed by one of them): waits right after the
// hand-over or after a rank-dependent pause of 0-39 us (the thread wakes within some of them
// and is adding the largest sum when the wait comes), in a rank-dependent order, a sum whose
// counts differ now and then; every result must be the rank-order sum, every mismatch the
// same text.
void waits_racing_the_thread(Communicator& c) {
  Communicator* comm = &c;
  const size_t limit = std::min<size_t>(comm->size_checked_sum_bytes() / sizeof(float), 16384);
  const bool odd = world_rank() == world_size() - 1;
  int64_t wrong = 0, mismatches = 0;
  std::string texts;
  for (int round = 0; round < 600; ++round) {
    const bool bad = world_size() > 1 && round % 111 == 5;
    std::vector<std::vector<float>> bufs;
    std::vector<Communicator::Request> reqs;
    for (int j = 0; j < 3; ++j) {
      const int k = 3 * round + j;
      const size_t len = bad && j == 1 ? (odd ? 5 : 6) : j == 0 ? limit : 1 + (k * 331u) % limit;
      bufs.push_back(mine<float>(k % 50, len));
      reqs.push_back(comm->start_all_reduce_sum(bufs[j].data(), len, DType::F32));
    }
    comm->progress_in_background();
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::microseconds((round * 7 + world_rank() * 13) % 40);
    while (std::chrono::steady_clock::now() < until) {
    }
    for (int i = 0; i < 3; ++i) {
      const int j = (i + round + world_rank()) % 3;
      try {
        comm->wait(reqs[j]);
        wrong += not_rank_order_local(bufs[j], (3 * round + j) % 50);
      } catch (const Error& e) {
        ++mismatches;
        texts = e.what();
      }
    }
  }
  EXPECT_EQ(sum_over_ranks(wrong), 0);
  const int64_t bad_rounds = world_size() > 1 ? 6 : 0;  // rounds 5, 116, 227, 338, 449, 560
  EXPECT_EQ(mismatches, bad_rounds);
  if (bad_rounds) {
    std::string want =
        "tpnorm: all_reduce_sum: the ranks disagree on the size of a sum: counts by rank [";
    for (int r = 0; r < world_size(); ++r) want += (r ? ", " : "") + std::string(r == world_size() - 1 ? "5" : "6");
    EXPECT_EQ(texts, want + "]");
  }
  EXPECT_EQ(comm->in_flight(), 0u);
}

TEST(CommSharedMemory, WaitsRacingTheProgressThreadGiveTheSameBits) {
  waits_racing_the_thread(*make_comm());
  // The thread pausing 200 us between claiming a sum and adding it: waits that come then
  // must wait for it (the test hook of comm/shm_exchange.cpp, read when the thread starts).
  auto slow = make_comm_with("TPNORM_SHM_TEST_ADD_DELAY_US", "200");
  waits_racing_the_thread(*slow);
}

}  // namespace
