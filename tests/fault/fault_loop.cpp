// fault_loop.cpp — the fault test's program: every rank runs a loop of LayerNorm calls on
// MPI_COMM_WORLD, and rank VICTIM SIGKILLs itself at iteration KILL_AT (mid-loop, between two
// collectives). The survivors are then stuck in a collective the victim never joins; the
// communicator's watchdog (TPNORM_TIMEOUT, short in the test) must end the job with its message.
// Exits 0 only if the loop finished, which is a failure for the driver (run_fault_test.sh).
//
// usage: fault_loop VICTIM KILL_AT ITERATIONS
#include <mpi.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s VICTIM KILL_AT ITERATIONS\n", argv[0]);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const int victim = std::atoi(argv[1]), kill_at = std::atoi(argv[2]), iters = std::atoi(argv[3]);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  {
    auto comm = tpnorm::make_mpi_communicator(MPI_COMM_WORLD);
    const int64_t R = 8, h = 16;
    std::vector<float> x(R * h, 1.0f + rank), y(R * h), mean(R), rstd(R);
    for (int i = 0; i < iters; ++i) {
      if (rank == victim && i == kill_at) {
        std::fprintf(stderr, "fault_loop: rank %d kills itself at iteration %d\n", rank, i);
        std::fflush(stderr);
        std::raise(SIGKILL);
      }
      tpnorm::layer_norm_forward(*comm, tpnorm::view(x.data(), {R, h}), {}, {},
                                 tpnorm::view(y.data(), {R, h}), tpnorm::view(mean.data(), {R}),
                                 tpnorm::view(rstd.data(), {R}));
    }
    std::printf("fault_loop: rank %d finished %d iterations\n", rank, iters);
  }
  MPI_Finalize();
  return 0;
}
