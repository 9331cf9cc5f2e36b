# Eigen adapter: <ddp/eigen.hpp> (tensor_traits for Eigen::Matrix, Eigen::Array, Eigen::Map,
# Eigen::Ref and the unsupported module's Eigen::Tensor). Never part of <ddp/ddp.hpp>.
#
# Target (INTERFACE, header-only):
#   ddp_eigen / ddp::eigen   links ddp_core and Eigen3::Eigen (Eigen's own package config; Debian:
#                            libeigen3-dev). Its include directory reaches us as SYSTEM.
#
# Sets DDP_WITH_EIGEN to TRUE when Eigen was found.

set(DDP_WITH_EIGEN FALSE)
find_package(Eigen3 3.3 QUIET NO_MODULE)
if(TARGET Eigen3::Eigen)
  add_library(ddp_eigen INTERFACE)
  add_library(ddp::eigen ALIAS ddp_eigen)
  set_target_properties(ddp_eigen PROPERTIES EXPORT_NAME eigen)
  target_link_libraries(ddp_eigen INTERFACE ddp_core Eigen3::Eigen)
  list(APPEND DDP_EXPORTED_TARGETS ddp_eigen)
  set(DDP_WITH_EIGEN TRUE)
  message(STATUS "ddp: Eigen ${Eigen3_VERSION} found; the eigen adapter is built")
else()
  message(STATUS "ddp: Eigen not found; the eigen adapter is not built")
endif()
