# The MPI library, by implementation (TPNORM_MPI):
#   ""       FindMPI's default: the mpicc on PATH (Debian: the `mpi` alternative, Open MPI
#            while both are installed, since Open MPI's alternative has the higher priority)
#   openmpi  Open MPI by its own names (mpicc.openmpi, mpirun.openmpi), whatever PATH says
#   mpich    MPICH by its own names (mpicc.mpich, Hydra's mpiexec.hydra), e.g. Debian's
#            mpich + libmpich-dev installed next to Open MPI; the preset cpu-mpich
# Sets TPNORM_MPI_FLAVOR (openmpi, mpich or other: what the found library is) for the tests,
# whose launch options differ between the two runtimes.
if(TPNORM_MPI STREQUAL "openmpi")
  set(tpnorm_mpi_cc mpicc.openmpi)
  set(tpnorm_mpiexec mpirun.openmpi)
  set(tpnorm_mpi_pkgs "openmpi-bin libopenmpi-dev")
elseif(TPNORM_MPI STREQUAL "mpich")
  set(tpnorm_mpi_cc mpicc.mpich)
  set(tpnorm_mpiexec mpiexec.hydra mpiexec.mpich)
  set(tpnorm_mpi_pkgs "mpich libmpich-dev")
elseif(NOT TPNORM_MPI STREQUAL "")
  message(FATAL_ERROR "TPNORM_MPI must be empty, openmpi or mpich, not '${TPNORM_MPI}'")
endif()
if(DEFINED tpnorm_mpi_cc)
  find_program(TPNORM_MPI_CC NAMES ${tpnorm_mpi_cc})
  find_program(TPNORM_MPIEXEC NAMES ${tpnorm_mpiexec})
  if(NOT TPNORM_MPI_CC OR NOT TPNORM_MPIEXEC)
    message(FATAL_ERROR "TPNORM_MPI=${TPNORM_MPI}: no ${tpnorm_mpi_cc} or ${tpnorm_mpiexec} "
                        "(Debian: apt-get install ${tpnorm_mpi_pkgs})")
  endif()
  # FindMPI asks the wrapper compiler for the flags, and runs the tests with this mpiexec.
  set(MPI_C_COMPILER ${TPNORM_MPI_CC} CACHE FILEPATH "MPI C compiler wrapper" FORCE)
  set(MPIEXEC_EXECUTABLE ${TPNORM_MPIEXEC} CACHE FILEPATH "mpiexec of the tests" FORCE)
endif()
find_package(MPI REQUIRED COMPONENTS C)

# What was found: MPICH (and its derivatives) and Open MPI define their version macros in mpi.h.
include(CheckSymbolExists)
set(CMAKE_REQUIRED_LIBRARIES MPI::MPI_C)
check_symbol_exists(MPICH_VERSION mpi.h TPNORM_MPI_IS_MPICH)
check_symbol_exists(OMPI_MAJOR_VERSION mpi.h TPNORM_MPI_IS_OPENMPI)
unset(CMAKE_REQUIRED_LIBRARIES)
if(TPNORM_MPI_IS_MPICH)
  set(TPNORM_MPI_FLAVOR mpich)
elseif(TPNORM_MPI_IS_OPENMPI)
  set(TPNORM_MPI_FLAVOR openmpi)
else()
  set(TPNORM_MPI_FLAVOR other)
endif()
if(TPNORM_MPI AND NOT TPNORM_MPI STREQUAL TPNORM_MPI_FLAVOR)
  message(FATAL_ERROR "TPNORM_MPI=${TPNORM_MPI}, but ${MPI_C_COMPILER} builds against "
                      "${TPNORM_MPI_FLAVOR} (a build directory keeps the MPI it was configured "
                      "with: use a new one)")
endif()
message(STATUS "tpnorm: MPI ${MPI_C_VERSION} (${TPNORM_MPI_FLAVOR}, ${MPI_C_COMPILER}), "
               "tests under ${MPIEXEC_EXECUTABLE}")
