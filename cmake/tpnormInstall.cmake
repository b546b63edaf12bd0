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

# The config's find_dependency lines for this build, written out (no if(ON) in the package):
# a static tpnorm carries its private OpenMP dependency into the consumer's link line; the CUDA
# backend needs the CUDA runtime, and NCCL through the FindNCCL installed beside the config.
get_target_property(TPNORM_LIBRARY_TYPE tpnorm TYPE)
set(TPNORM_CONFIG_DEPENDENCIES "")
if(TPNORM_LIBRARY_TYPE STREQUAL "STATIC_LIBRARY")
  string(APPEND TPNORM_CONFIG_DEPENDENCIES "find_dependency(OpenMP COMPONENTS CXX)\n")
endif()
if(TPNORM_WITH_CUDA)
  string(APPEND TPNORM_CONFIG_DEPENDENCIES "find_dependency(CUDAToolkit)\n")
endif()
if(TPNORM_WITH_NCCL)
  string(APPEND TPNORM_CONFIG_DEPENDENCIES
         "list(APPEND CMAKE_MODULE_PATH \${CMAKE_CURRENT_LIST_DIR})\nfind_dependency(NCCL)\n")
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
