// tpnorm/mpi.h — MPI communicators (host buffers). Include only where MPI is available.
#pragma once

#include <mpi.h>

#include <memory>

#include "tpnorm/communicator.h"

namespace tpnorm {

/// A communicator over `comm`. tpnorm works on an MPI_Comm_dup of `comm` (so its traffic never
/// matches the caller's own messages) and frees the duplicate on destruction; `comm` itself
/// stays the caller's. MPI must be initialised; collective over `comm`.
/// Throws tpnorm::Error(kCommunication) if MPI fails.
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm);

}  // namespace tpnorm
