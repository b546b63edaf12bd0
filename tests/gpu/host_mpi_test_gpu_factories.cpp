// The device communicators' MPI factories under mpiexec at 3 ranks (host test: it needs no
// GPU, and on a machine without one it is the case it checks). Every step that can fail on
// one rank is agreed before any step that waits for peers, so each factory throws the same
// tpnorm::Error (code and message, naming the first failing rank) on every rank, and no rank
// is left waiting in MPI_Comm_dup or ncclCommInitRank. Rank 1 asks for a device that does not
// exist; with no CUDA device every rank fails its first step. With a GPU the same calls fail
// on rank 1 only, and the others must still throw its error.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstring>
#include <string>
#include <vector>

#include "harness.h"
#include "tpnorm/cuda_mpi.h"
#include "tpnorm/error.h"

using namespace tpnorm;

namespace {

struct Outcome {
  bool threw = false;
  int code = -1;
  std::string message;
};

template <class Fn>
Outcome outcome_of(Fn&& fn) {
  Outcome o;
  try {
    auto comm = fn();
  } catch (const Error& e) {
    o.threw = true;
    o.code = static_cast<int>(e.code());
    o.message = e.what();
  }
  return o;
}

// Every rank threw, with rank 0's code and message.
void expect_same_error_everywhere(const Outcome& o, const char* factory) {
  EXPECT_TRUE(o.threw) << factory << " did not throw on rank " << tpnorm_test::world_rank();
  char mine[512] = {}, first[512] = {};
  std::strncpy(mine, o.message.c_str(), sizeof mine - 1);
  std::memcpy(first, mine, sizeof first);
  MPI_Bcast(first, sizeof first, MPI_CHAR, 0, MPI_COMM_WORLD);
  int code0 = o.code;
  MPI_Bcast(&code0, 1, MPI_INT, 0, MPI_COMM_WORLD);
  const int same = std::strcmp(mine, first) == 0 && o.code == code0 && o.threw;
  int all = 0;
  MPI_Allreduce(&same, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(all, tpnorm_test::world_size())
      << factory << ": rank " << tpnorm_test::world_rank() << " got \"" << mine
      << "\", rank 0 got \"" << first << "\"";
  EXPECT_NE(o.message.find(factory), std::string::npos) << o.message;
  EXPECT_NE(o.message.find("failed on rank"), std::string::npos) << o.message;
}

int bad_device_on_rank1() { return tpnorm_test::world_rank() == 1 ? 1000 : 0; }

TEST(GpuFactories, StagedFactoryFailsTogether) {
  const Outcome o = outcome_of([] {
    return make_mpi_staged_cuda_communicator(MPI_COMM_WORLD, nullptr, bad_device_on_rank1());
  });
  expect_same_error_everywhere(o, "make_mpi_staged_cuda_communicator");
  MPI_Barrier(MPI_COMM_WORLD);  // nobody is still inside the factory
}

#ifdef TPNORM_WITH_NCCL
TEST(GpuFactories, NcclFactoryWithDeviceFailsTogether) {
  const Outcome o = outcome_of(
      [] { return make_nccl_communicator(MPI_COMM_WORLD, nullptr, bad_device_on_rank1()); });
  expect_same_error_everywhere(o, "make_nccl_communicator");
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(GpuFactories, NcclFactoryChoosingTheDeviceFailsTogetherWithoutAGpu) {
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0)
    GTEST_SKIP() << "a GPU is visible: this case is the no-device one";
  cudaGetLastError();
  const Outcome o = outcome_of([] { return make_nccl_communicator(MPI_COMM_WORLD, nullptr); });
  expect_same_error_everywhere(o, "make_nccl_communicator");
  MPI_Barrier(MPI_COMM_WORLD);
}
#endif

}  // namespace
