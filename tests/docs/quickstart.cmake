# quickstart.cmake — README.md's quick starts, run as written: extract the blocks marked
# <!-- docs-test: quickstart/NAME --> into WORK (fresh each time), then
#   with BUILD_DIR:    install tpnorm into WORK/stage, configure quickstart/CMakeLists.txt
#                      against it (find_package), build it and run its program at 2 ranks;
#   with TORCH_PYTHON: run quickstart/quickstart.py at 2 ranks with that interpreter.
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK})
step(${PYTHON} ${SOURCE_DIR}/tests/docs/check_docs.py ${SOURCE_DIR} --extract ${WORK})
set(qs ${WORK}/quickstart)

if(DEFINED BUILD_DIR)
  foreach(f CMakeLists.txt main.cpp)
    if(NOT EXISTS ${qs}/${f})
      message(FATAL_ERROR "README.md has no <!-- docs-test: quickstart/${f} --> block")
    endif()
  endforeach()
  step(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK}/stage)
  step(${CMAKE_COMMAND} -S ${qs} -B ${WORK}/build -G ${GENERATOR} -DCMAKE_BUILD_TYPE=Release
       -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_PREFIX_PATH=${WORK}/stage
       -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF "-DCMAKE_EXE_LINKER_FLAGS=${LINK_FLAGS}")
  step(${CMAKE_COMMAND} --build ${WORK}/build)
  file(READ ${qs}/CMakeLists.txt text)
  if(NOT text MATCHES "add_executable\\(([A-Za-z0-9_-]+)")
    message(FATAL_ERROR "quickstart/CMakeLists.txt has no add_executable")
  endif()
  step(${MPIEXEC} ${NPFLAG} 2 ${WORK}/build/${CMAKE_MATCH_1})
endif()

if(DEFINED TORCH_PYTHON)
  if(NOT EXISTS ${qs}/quickstart.py)
    message(FATAL_ERROR "README.md has no <!-- docs-test: quickstart/quickstart.py --> block")
  endif()
  step(${MPIEXEC} ${NPFLAG} 2 ${TORCH_PYTHON} ${qs}/quickstart.py)
endif()
