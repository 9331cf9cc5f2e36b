# gloo backend and rendezvous stores.
#
# Targets (all INTERFACE, header-only on our side):
#   ddp_gloo  / ddp::gloo   the gloo communicator (include <ddp/gloo.hpp>); links ddp_core and libgloo.
#   ddp_redis / ddp::redis  the Redis rendezvous store (include <ddp/stores/redis_store.hpp>); links
#                           ddp_core and hiredis. Only defined when hiredis is found.
# The store concept, the file store and the namespacing wrapper need nothing beyond ddp_core.
#
# Sets DDP_WITH_GLOO (and DDP_WITH_REDIS) to TRUE when the dependency was found. This file is
# include()d at the top level, so plain set() reaches the rest of the project.

# libgloo: Debian's libgloo-dev ships a CMake package (imported target `gloo`). Imported targets'
# include directories are SYSTEM includes for consumers, which matters: gloo's headers trip
# -Wsign-compare and several clang warnings under -Werror.
find_package(Gloo CONFIG QUIET)
if(NOT TARGET gloo)
  # No package file (gloo built by hand): look for the header and library directly and make the
  # same imported target, so exported targets name `gloo` either way.
  find_path(DDP_GLOO_INCLUDE_DIR gloo/allreduce.h)
  find_library(DDP_GLOO_LIBRARY gloo)
  if(DDP_GLOO_INCLUDE_DIR AND DDP_GLOO_LIBRARY)
    add_library(gloo SHARED IMPORTED)
    set_target_properties(gloo PROPERTIES
      IMPORTED_LOCATION "${DDP_GLOO_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${DDP_GLOO_INCLUDE_DIR}")
  endif()
endif()

if(TARGET gloo)
  add_library(ddp_gloo INTERFACE)
  add_library(ddp::gloo ALIAS ddp_gloo)
  set_target_properties(ddp_gloo PROPERTIES EXPORT_NAME gloo)
  target_link_libraries(ddp_gloo INTERFACE ddp_core gloo)
  list(APPEND DDP_EXPORTED_TARGETS ddp_gloo)
  set(DDP_WITH_GLOO TRUE)
  message(STATUS "ddp: gloo found (${Gloo_DIR}${DDP_GLOO_LIBRARY})")

  # ddp_add_gloo_bench(<source>): the gloo allreduce bandwidth bench (called from bench/). With
  # the MPI backend it also times ddp::mpi and MPI_Allreduce when launched with `mpiexec ... --mpi`.
  # Smoke runs (label bench;gloo) prove it runs, not speed.
  function(ddp_add_gloo_bench source)
    add_executable(gloo_bench ${source})
    target_link_libraries(gloo_bench PRIVATE ddp_gloo ddp_dev_flags)
    if(TARGET ddp_mpi)
      target_link_libraries(gloo_bench PRIVATE ddp_mpi)
      target_compile_definitions(gloo_bench PRIVATE DDP_GLOO_BENCH_WITH_MPI=1)
    endif()
    if(DDP_BUILD_TESTS)
      set(out ${CMAKE_CURRENT_BINARY_DIR}/smoke)
      file(MAKE_DIRECTORY ${out})
      add_test(NAME bench.gloo COMMAND gloo_bench --np 2 --max-bytes 65536 --iters 3 --repeat 1 --csv ${out}/gloo.csv)
      set_tests_properties(bench.gloo PROPERTIES LABELS "bench;gloo" TIMEOUT 30 PROCESSORS 2)
      if(TARGET ddp_mpi)
        ddp_add_mpi_test(bench.gloo_mpi RANKS 2 LABELS "bench;gloo" TIMEOUT 30
          COMMAND $<TARGET_FILE:gloo_bench> --mpi --max-bytes 65536 --iters 3 --repeat 1 --csv ${out}/gloo_mpi.csv)
      endif()
    endif()
  endfunction()
else()
  message(STATUS "ddp: gloo not found; the gloo backend is not built")
endif()

# hiredis, for the Redis store. We include <hiredis/hiredis.h> (the nested form), so only the
# library is needed from it.
set(DDP_WITH_REDIS FALSE)
find_path(DDP_HIREDIS_INCLUDE_DIR hiredis/hiredis.h)
find_library(DDP_HIREDIS_LIBRARY hiredis)
if(DDP_HIREDIS_INCLUDE_DIR AND DDP_HIREDIS_LIBRARY)
  add_library(ddp_redis INTERFACE)
  add_library(ddp::redis ALIAS ddp_redis)
  set_target_properties(ddp_redis PROPERTIES EXPORT_NAME redis)
  target_link_libraries(ddp_redis INTERFACE ddp_core "${DDP_HIREDIS_LIBRARY}")
  list(APPEND DDP_EXPORTED_TARGETS ddp_redis)
  set(DDP_WITH_REDIS TRUE)
endif()
message(STATUS "ddp: Redis store (hiredis): ${DDP_WITH_REDIS}")
