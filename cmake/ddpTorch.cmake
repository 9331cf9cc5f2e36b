# libtorch adapter: <ddp/torch.hpp> (at::Tensor traits, AccumulateGrad hook registry,
# register_module). Never part of the core or of <ddp/ddp.hpp>.
#
# Target (INTERFACE, header-only on our side):
#   ddp_torch / ddp::torch   links ddp_core and ${TORCH_LIBRARIES} (imported targets `torch` and
#                            `torch_library` from libtorch's TorchConfig.cmake, plus libc10).
#
# Sets DDP_WITH_TORCH to TRUE when Torch was found. include()d at the top level, so plain set()
# reaches the rest of the project.
#
# libtorch's headers warn a lot under -Wall -Wextra -Wpedantic. They reach our targets through the
# imported target `torch`, whose include directories consumers see as SYSTEM, and Debian installs
# them below /usr/include, a system directory anyway: their warnings never fail a -Werror build.

set(DDP_WITH_TORCH FALSE)
find_package(Torch QUIET)
if(Torch_FOUND AND TARGET torch)
  add_library(ddp_torch INTERFACE)
  add_library(ddp::torch ALIAS ddp_torch)
  set_target_properties(ddp_torch PROPERTIES EXPORT_NAME torch)
  target_link_libraries(ddp_torch INTERFACE ddp_core ${TORCH_LIBRARIES})
  list(APPEND DDP_EXPORTED_TARGETS ddp_torch)
  set(DDP_WITH_TORCH TRUE)
  message(STATUS "ddp: libtorch found (${Torch_DIR}); the torch adapter is built")
else()
  message(STATUS "ddp: libtorch not found; the torch adapter is not built")
endif()
