# install_and_consume.cmake — install tpnorm from BUILD_DIR into STAGE, check the installed
# config, then configure, build and run (at 2 ranks) each consumer project against it: the
# C++-only one (consumer/) and the C one (consumer_c/). Fresh directories each time, so a stale
# cache or an old install cannot make it pass.
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()

file(REMOVE_RECURSE ${STAGE} ${CONSUMER_BUILD})
step(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${STAGE})
# The generated config carries this build's dependencies as plain lines, no if(ON) / if(OFF).
file(GLOB_RECURSE config ${STAGE}/*/tpnormConfig.cmake)
file(READ "${config}" text)
if(text MATCHES "if\\((ON|OFF|TRUE|FALSE|1|0)\\)")
  message(FATAL_ERROR "${config} has a literal if(${CMAKE_MATCH_1})")
endif()
foreach(consumer consumer consumer_c)
  set(build ${CONSUMER_BUILD}/${consumer})
  step(${CMAKE_COMMAND} -S ${CONSUMER_SRC}/${consumer} -B ${build} -G ${GENERATOR}
       -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_C_COMPILER=${CC}
       -DCMAKE_PREFIX_PATH=${STAGE} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
       -DTPNORM_EXPECT_PREFIX=${STAGE} "-DCMAKE_EXE_LINKER_FLAGS=${LINK_FLAGS}")
  step(${CMAKE_COMMAND} --build ${build})
  file(GLOB exe ${build}/tpnorm_*consumer)
  step(${MPIEXEC} ${NPFLAG} 2 ${exe})
endforeach()
