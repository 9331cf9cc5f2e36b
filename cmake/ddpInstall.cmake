# Install rules and the CMake package (include()d by the top level when DDP_INSTALL is ON).
#
# Layout (header-only, so architecture-independent, like nlohmann_json):
#   include/ddp/...                      every public header, backends included
#   share/cmake/ddp/ddpConfig.cmake      components = the backends this build exported
#   share/cmake/ddp/ddpConfigVersion.cmake
#   share/cmake/ddp/ddpTargets.cmake     ddp::ddp, ddp::mpi, ddp::cuda, ddp::nccl, ...
#   share/cmake/ddp/FindNCCL.cmake       NCCL ships no package config before 2.29.7
#   bin/ddp-run                          the MPI launcher that survives mpiexec's teardown hang
#   bin/ddp-hosts                        test hosts on one machine (ddp-run --hosts)
#   bin/ddp-slurm                        a Slurm cluster on test hosts (ddp-run --hosts --slurm)
#   bin/ddp-supervise                    runs a fault-tolerant job's replicas, restarting the dead
# The build tree gets the same files in ${PROJECT_BINARY_DIR}, so `-Dddp_DIR=<build dir>` works
# without installing.

include(CMakePackageConfigHelpers)

set(DDP_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/ddp"
    CACHE STRING "Where ddpConfig.cmake is installed, relative to the prefix")

# Components are the export names of the backend targets (ddp_mpi -> mpi, ...). ddp_core
# (export name `ddp`) is the package itself, not a component. Recorded per target, so any target
# the top level or cmake/ddpGloo.cmake adds to DDP_EXPORTED_TARGETS becomes a component.
set(DDP_AVAILABLE_COMPONENTS)
foreach(_ddp_target IN LISTS DDP_EXPORTED_TARGETS)
  get_target_property(_ddp_export_name ${_ddp_target} EXPORT_NAME)
  if(NOT _ddp_export_name)
    set(_ddp_export_name ${_ddp_target})
  endif()
  if(NOT _ddp_export_name STREQUAL "ddp")
    list(APPEND DDP_AVAILABLE_COMPONENTS ${_ddp_export_name})
  endif()
endforeach()

# What the gloo hook of ddpConfig.cmake needs to recreate the `gloo` imported target when gloo
# has no package config on the consumer's machine (see cmake/ddpGloo.cmake).
set(DDP_CONFIG_GLOO_INCLUDE_DIR "")
set(DDP_CONFIG_GLOO_LIBRARY "")
if(TARGET gloo)
  get_target_property(_ddp_gloo_imported gloo IMPORTED)
  if(_ddp_gloo_imported AND DEFINED DDP_GLOO_LIBRARY AND DDP_GLOO_LIBRARY)
    set(DDP_CONFIG_GLOO_INCLUDE_DIR "${DDP_GLOO_INCLUDE_DIR}")
    set(DDP_CONFIG_GLOO_LIBRARY "${DDP_GLOO_LIBRARY}")
  endif()
endif()

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/ddp"
        DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        FILES_MATCHING PATTERN "*.hpp" PATTERN "*.cuh")
install(PROGRAMS "${PROJECT_SOURCE_DIR}/scripts/ddp-run" "${PROJECT_SOURCE_DIR}/scripts/ddp-hosts"
                 "${PROJECT_SOURCE_DIR}/scripts/ddp-slurm" "${PROJECT_SOURCE_DIR}/scripts/ddp-supervise"
        DESTINATION "${CMAKE_INSTALL_BINDIR}")
install(TARGETS ${DDP_EXPORTED_TARGETS} EXPORT ddpTargets)
install(EXPORT ddpTargets
        NAMESPACE ddp::
        DESTINATION "${DDP_INSTALL_CMAKEDIR}"
        FILE ddpTargets.cmake)

write_basic_package_version_file("${PROJECT_BINARY_DIR}/ddpConfigVersion.cmake"
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion  # 0.x: every minor release may break the API
  ARCH_INDEPENDENT)

# Install tree.
set(DDP_CONFIG_RUN_PATH "${CMAKE_INSTALL_BINDIR}/ddp-run")
configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/ddpConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/ddp-install/ddpConfig.cmake"
  INSTALL_DESTINATION "${DDP_INSTALL_CMAKEDIR}"
  PATH_VARS DDP_CONFIG_RUN_PATH)
install(FILES
          "${PROJECT_BINARY_DIR}/ddp-install/ddpConfig.cmake"
          "${PROJECT_BINARY_DIR}/ddpConfigVersion.cmake"
          "${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake"
        DESTINATION "${DDP_INSTALL_CMAKEDIR}")

# Build tree: the launcher is used from the source tree.
set(DDP_CONFIG_RUN_PATH "${PROJECT_SOURCE_DIR}/scripts/ddp-run")
export(EXPORT ddpTargets NAMESPACE ddp:: FILE "${PROJECT_BINARY_DIR}/ddpTargets.cmake")
configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/ddpConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/ddpConfig.cmake"
  INSTALL_DESTINATION "${PROJECT_BINARY_DIR}"
  INSTALL_PREFIX "${PROJECT_BINARY_DIR}"
  PATH_VARS DDP_CONFIG_RUN_PATH)
configure_file("${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake" "${PROJECT_BINARY_DIR}/FindNCCL.cmake" COPYONLY)

unset(_ddp_target)
unset(_ddp_export_name)
unset(_ddp_gloo_imported)
