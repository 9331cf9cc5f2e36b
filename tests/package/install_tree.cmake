# Fixture of the package tests: installs the build tree BUILD_DIR into PREFIX, emptied first so
# files removed from the project do not linger, and checks that the EXPECTED files are there.
#   cmake -DBUILD_DIR=... -DPREFIX=... [-DCONFIG=...] [-DEXPECTED=a|b|...] -P install_tree.cmake
# (EXPECTED: paths relative to PREFIX)
foreach(required IN ITEMS BUILD_DIR PREFIX)
  if(NOT DEFINED ${required})
    message(FATAL_ERROR "install_tree.cmake: ${required} is not set")
  endif()
endforeach()

file(REMOVE_RECURSE "${PREFIX}")
set(config_args)
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
execute_process(
  COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" ${config_args}
  RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed: ${result}")
endif()

string(REPLACE "|" ";" EXPECTED "${EXPECTED}")
foreach(file IN LISTS EXPECTED)
  if(NOT EXISTS "${PREFIX}/${file}")
    message(FATAL_ERROR "install_tree.cmake: ${PREFIX}/${file} was not installed")
  endif()
endforeach()
message(STATUS "ddp installed into ${PREFIX}")
