# install_and_consume.cmake — install tpnorm from BUILD_DIR into STAGE, then configure, build
# and run (at 2 ranks) the consumer project against it. Fresh directories each time, so a stale
# cache or an old install cannot make it pass.
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()

file(REMOVE_RECURSE ${STAGE} ${CONSUMER_BUILD})
step(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${STAGE})
step(${CMAKE_COMMAND} -S ${CONSUMER_SRC} -B ${CONSUMER_BUILD} -G ${GENERATOR}
     -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_C_COMPILER=${CC}
     -DCMAKE_PREFIX_PATH=${STAGE} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
     -DTPNORM_EXPECT_PREFIX=${STAGE} "-DCMAKE_EXE_LINKER_FLAGS=${LINK_FLAGS}")
step(${CMAKE_COMMAND} --build ${CONSUMER_BUILD})
step(${MPIEXEC} ${NPFLAG} 2 ${CONSUMER_BUILD}/tpnorm_consumer)
