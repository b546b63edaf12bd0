// mpi_main.cpp — the gtest main of every tpnorm test binary, single- or multi-rank.
//
// Every rank runs every test; after each test the ranks agree on its verdict (a test that
// failed on any rank is reported by rank 0 with the ranks it failed on), and every rank exits
// with the same code. A watchdog ends a rank whose test runs past TPNORM_TEST_TIMEOUT seconds
// (default 300): mpiexec then ends the job, so a test that would hang fails instead.
#include <gtest/gtest.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

namespace {

std::atomic<long> g_test_started{0};  // seconds since epoch; 0 = no test running
std::string g_test_name;

long now_s() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class AgreeListener : public ::testing::EmptyTestEventListener {
 public:
  explicit AgreeListener(int rank) : rank_(rank) {}
  void OnTestStart(const ::testing::TestInfo& t) override {
    g_test_name = std::string(t.test_suite_name()) + "." + t.name();
    g_test_started = now_s();
  }
  void OnTestEnd(const ::testing::TestInfo& t) override {
    g_test_started = 0;
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size == 1) return;
    const int mine = t.result()->Failed() ? 1 : 0;
    std::vector<int> all(static_cast<size_t>(size));
    MPI_Allgather(&mine, 1, MPI_INT, all.data(), 1, MPI_INT, MPI_COMM_WORLD);
    std::string ranks;
    for (int r = 0; r < size; ++r)
      if (all[r]) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
    if (!ranks.empty()) {
      any_failed_ = true;
      if (rank_ == 0)
        std::printf("[  RANKS   ] %s.%s failed on rank(s) %s of %d\n", t.test_suite_name(),
                    t.name(), ranks.c_str(), size);
    }
  }
  bool any_failed() const { return any_failed_; }

 private:
  int rank_;
  bool any_failed_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  ::testing::InitGoogleTest(&argc, argv);

  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    // Other ranks print failures only (gtest prints assertion failures through this printer).
    delete listeners.Release(listeners.default_result_printer());
    struct FailurePrinter : ::testing::EmptyTestEventListener {
      int r;
      explicit FailurePrinter(int rr) : r(rr) {}
      void OnTestPartResult(const ::testing::TestPartResult& p) override {
        if (p.failed())
          std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", r,
                       p.file_name() ? p.file_name() : "?", p.line_number(), p.summary());
      }
    };
    listeners.Append(new FailurePrinter(rank));
  }
  auto* agree = new AgreeListener(rank);
  listeners.Append(agree);

  const char* t = std::getenv("TPNORM_TEST_TIMEOUT");
  const long timeout = t && *t ? std::atol(t) : 300;
  std::thread([rank, timeout] {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      const long s = g_test_started.load();
      if (s && now_s() - s > timeout) {
        std::fprintf(stderr, "[rank %d] watchdog: %s ran past %ld s; ending this rank\n", rank,
                     g_test_name.c_str(), timeout);
        std::fflush(stderr);
        std::_Exit(124);
      }
    }
  }).detach();

  int rc = RUN_ALL_TESTS();
  if (agree->any_failed()) rc = 1;
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
