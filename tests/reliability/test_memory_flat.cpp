// 10^5 consecutive calls (LayerNorm / RMSNorm forward and backward; every 50th call is a
// forward with a bad eps on rank 0, so the error path with its diagnostic collective is exercised
// too) must leave the resident set flat: a leak of 8 bytes per call would add 800 KB. The resident
// size is read from /proc/self/statm after a warm-up of 10^4 calls and after the 10^5 calls.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>

#include "harness.h"
#include "tpnorm/error.h"
#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

long resident_bytes() {
  long size = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return -1;
  const int n = std::fscanf(f, "%ld %ld", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * sysconf(_SC_PAGESIZE) : -1;
}

TEST(MemoryFlat, HundredThousandCallsKeepResidentMemoryFlat) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  comm->set_strict_calls(16);  // the default: strict first calls, then folded
  const int64_t R = 4, h = 8;
  const Shape s{R, h}, r{R}, p{h};
  std::vector<float> x = normal(1, world_rank(), R * h), y(R * h), dx(R * h), g(h, 1.f), dg(h),
                     db(h), mean(R), rstd(R);
  int64_t errors = 0;
  auto call = [&](int64_t i) {
    NormOptions o;
    if (i % 50 == 48 && world_rank() == 0) o.eps = -1;  // a forward (48 % 4 == 0, 98 % 4 == 2)
    try {
      switch (i % 4) {
        case 0:
          layer_norm_forward(*comm, view(x.data(), s), view(g.data(), p), {}, view(y.data(), s),
                             view(mean.data(), r), view(rstd.data(), r), o);
          break;
        case 1:
          layer_norm_backward(*comm, view(x.data(), s), view(x.data(), s), view(g.data(), p),
                              view(mean.data(), r), view(rstd.data(), r), view(dx.data(), s),
                              view(dg.data(), p), view(db.data(), p), o);
          break;
        case 2:
          rms_norm_forward(*comm, view(x.data(), s), view(g.data(), p), view(y.data(), s),
                           view(rstd.data(), r), o);
          break;
        default:
          rms_norm_backward(*comm, view(x.data(), s), view(x.data(), s), view(g.data(), p),
                            view(rstd.data(), r), view(dx.data(), s), view(dg.data(), p), o);
      }
    } catch (const Error&) {
      ++errors;
    }
  };
  constexpr int64_t kWarmup = 10000, kCalls = 100000;
  for (int64_t i = 0; i < kWarmup; ++i) call(i);
  const long before = resident_bytes();
  errors = 0;
  for (int64_t i = 0; i < kCalls; ++i) call(i);
  const long after = resident_bytes();
  ASSERT_GT(before, 0) << "cannot read /proc/self/statm";
  EXPECT_EQ(errors, kCalls / 50);  // every rank throws on the failing calls
  const long growth = after - before;
  std::printf("[rank %d] resident %ld KiB before, %ld KiB after %lld calls: %+ld KiB\n",
              world_rank(), before / 1024, after / 1024, static_cast<long long>(kCalls),
              growth / 1024);
  EXPECT_LE(growth, 256 * 1024) << "resident memory grew by " << growth << " bytes";
}

}  // namespace
