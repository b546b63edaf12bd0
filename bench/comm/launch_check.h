// launch_check.h — the rank of this process before MPI_Init, and the srun-without-PMIx trap.
//
// `srun -n 4 prog` with an OpenMPI that cannot talk to srun's process manager (no PMIx plugin,
// `srun --mpi=list`) starts 4 processes that each initialise MPI alone: 4 singletons of world
// size 1, which a benchmark would happily run as 4 separate 1-rank jobs. Every launcher says
// how many tasks it started (OpenMPI's mpirun OMPI_COMM_WORLD_SIZE, srun SLURM_STEP_NUM_TASKS,
// ./launch/tpnorm run TPNORM_WORLD_SIZE); a world size that disagrees is an error at start.
#pragma once

#include <cstdlib>
#include <string>

namespace tpnorm_bench {

/// The rank the launcher gave this process (0 when none did), readable before MPI_Init.
inline int launcher_rank() {
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return 0;
}

/// Empty when the MPI world size `mpi_size` is what the launcher started, else a one-line
/// message saying what disagrees and what to do.
inline std::string launch_mismatch(int mpi_size) {
  struct Source {
    const char* var;
    const char* who;
  };
  // mpirun's own count first: under mpirun inside a Slurm allocation the SLURM_ variables
  // describe the step that started mpirun's daemons, not the ranks.
  const Source sources[] = {{"TPNORM_WORLD_SIZE", "./launch/tpnorm run"},
                            {"OMPI_COMM_WORLD_SIZE", "mpirun"},
                            {"SLURM_STEP_NUM_TASKS", "srun"}};
  for (const Source& s : sources) {
    const char* v = std::getenv(s.var);
    if (!v || !*v) continue;
    const int want = std::atoi(v);
    if (want == mpi_size) return {};
    std::string m = "MPI world size is " + std::to_string(mpi_size) + " but " + s.who +
                    " started " + std::to_string(want) + " tasks (" + s.var + "=" + v + ")";
    if (mpi_size == 1)
      m += ": each task initialised MPI alone (a singleton); under Slurm use srun --mpi=pmix "
           "(see srun --mpi=list) or mpirun";
    return m;
  }
  return {};
}

}  // namespace tpnorm_bench
