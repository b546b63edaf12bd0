# The package tests must exercise the staged install, never a copy found elsewhere on the
# machine (included by each consumer after find_package(tpnorm)).
if(DEFINED TPNORM_EXPECT_PREFIX)
  file(REAL_PATH ${tpnorm_DIR} found)
  file(REAL_PATH ${TPNORM_EXPECT_PREFIX} want)
  string(FIND "${found}" "${want}/" at)
  if(NOT at EQUAL 0)
    message(FATAL_ERROR "tpnorm found at ${found}, not under ${want}")
  endif()
endif()
