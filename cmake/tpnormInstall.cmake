# tpnormInstall.cmake — `cmake --install` writes the library, the public headers and a CMake
# package, so that another project can say:
#   find_package(tpnorm CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE tpnorm::tpnorm)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(TPNORM_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/tpnorm)
install(TARGETS tpnorm EXPORT tpnormTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT tpnormTargets NAMESPACE tpnorm:: DESTINATION ${TPNORM_INSTALL_CMAKEDIR})

# A static tpnorm carries its private OpenMP dependency into the consumer's link line.
get_target_property(TPNORM_LIBRARY_TYPE tpnorm TYPE)
if(TPNORM_LIBRARY_TYPE STREQUAL "STATIC_LIBRARY")
  set(TPNORM_NEEDS_OPENMP ON)
else()
  set(TPNORM_NEEDS_OPENMP OFF)
endif()
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/tpnormConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/tpnormConfig.cmake
                              INSTALL_DESTINATION ${TPNORM_INSTALL_CMAKEDIR})
# 0.x: minor versions may break the API, so only the same minor version is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/tpnormConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/tpnormConfig.cmake
              ${PROJECT_BINARY_DIR}/tpnormConfigVersion.cmake
        DESTINATION ${TPNORM_INSTALL_CMAKEDIR})
if(TPNORM_WITH_NCCL)
  install(FILES ${CMAKE_CURRENT_LIST_DIR}/FindNCCL.cmake DESTINATION ${TPNORM_INSTALL_CMAKEDIR})
endif()
