// tpnorm/mpi.h — MPI communicators (host buffers). Include only where MPI is available.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>

#include "tpnorm/communicator.h"

namespace tpnorm {

/// A communicator over `comm`. tpnorm works on an MPI_Comm_dup of `comm` (so its traffic never
/// matches the caller's own messages) and frees the duplicate on destruction; `comm` itself
/// stays the caller's. MPI must be initialised; collective over `comm`.
/// Throws tpnorm::Error(kCommunication) if MPI fails.
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm);

/// Sums of `comm` (one made by make_mpi_communicator; 0 for any other) that went through the
/// shared-memory window: small sums (at most size_checked_sum_bytes() per rank) when every rank
/// is on one node and the environment variable TPNORM_SHM is not "0" (read when the
/// communicator is made; the ranks' minimum decides). The others go as MPI messages.
uint64_t mpi_shared_memory_sums(const Communicator& comm);

/// Of those, the sums that the communicator's progress thread added while the caller was
/// elsewhere (split-phase calls hand their started sums to it: Communicator::
/// progress_in_background); the others were added by their wait.
uint64_t mpi_background_sums(const Communicator& comm);

/// Waits on `comm`'s started sums that found their sum already added without error (by the
/// progress thread) and returned at once, touching only the communicator itself (for tests
/// and benchmarks: the quick path actually taken; docs/split-phase.md).
uint64_t mpi_quick_waits(const Communicator& comm);

}  // namespace tpnorm
