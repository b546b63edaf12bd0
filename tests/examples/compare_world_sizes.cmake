# compare_world_sizes.cmake — runs an example at 1 rank, writing its per-step losses, then at
# each of RANKS checking its losses against that log (the example itself compares, see
# examples/common/loss_log.h, and exits non-zero beyond TOL).
#   cmake -DMPIEXEC=... -DNPFLAG=-n -DEXE=... "-DARGS=a;b" "-DRANKS=2;4" -DTOL=... -DLOG=... -P
foreach(np 1 ${RANKS})
  if(np EQUAL 1)
    set(mode --write ${LOG})
  else()
    set(mode --check ${LOG} --tol ${TOL})
  endif()
  execute_process(COMMAND ${MPIEXEC} ${NPFLAG} ${np} ${EXE} ${ARGS} ${mode} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${EXE} ${ARGS} at ${np} ranks failed (${rc})")
  endif()
endforeach()
