# Helpers for the project's own tests, examples and benchmarks (never exported).

# ddp_dev_flags(target): warnings (as errors) and sanitizers, on our own targets only.
add_library(ddp_dev_flags INTERFACE)
target_compile_options(ddp_dev_flags INTERFACE -Wall -Wextra -Wpedantic
  $<$<BOOL:${DDP_WARNINGS_AS_ERRORS}>:-Werror>)
if(DDP_SANITIZE)
  list(JOIN DDP_SANITIZE "," _ddp_san)
  target_compile_options(ddp_dev_flags INTERFACE -fsanitize=${_ddp_san} -fno-omit-frame-pointer -g)
  target_link_options(ddp_dev_flags INTERFACE -fsanitize=${_ddp_san})
endif()

# Environment every MPI run needs on our machines (root in CI, 2 cores, oversubscription).
set(DDP_MPI_TEST_ENV
  "OMPI_ALLOW_RUN_AS_ROOT=1"
  "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
  "OMPI_MCA_rmaps_base_oversubscribe=1"
  "PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe"
  "OMPI_MCA_pml=ob1"
  "OMPI_MCA_btl=self,vader"
  "ASAN_OPTIONS=detect_leaks=0")
set(DDP_MPIEXEC_OVERSUBSCRIBE "")
if(MPI_CXX_LIBRARY_VERSION_STRING MATCHES "Open MPI")
  set(DDP_MPIEXEC_OVERSUBSCRIBE "--oversubscribe")
endif()

# ddp_mpi_command(<out-var> <ranks> <args...>): the launcher command line for <ranks> ranks.
function(ddp_mpi_command out ranks)
  set(${out} ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} ${DDP_MPIEXEC_OVERSUBSCRIBE}
      ${MPIEXEC_PREFLAGS} ${ARGN} ${MPIEXEC_POSTFLAGS} PARENT_SCOPE)
endfunction()

# ddp_add_mpi_test(<name> COMMAND <exe-and-args...> RANKS <n...> [LABELS ...] [TIMEOUT s])
# registers <name>.np<N> for each N, run through mpiexec with the environment above.
function(ddp_add_mpi_test name)
  cmake_parse_arguments(A "" "TIMEOUT" "COMMAND;RANKS;LABELS" ${ARGN})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 120)
  endif()
  foreach(n IN LISTS A_RANKS)
    ddp_mpi_command(cmd ${n} ${A_COMMAND})
    add_test(NAME ${name}.np${n} COMMAND ${cmd})
    set_tests_properties(${name}.np${n} PROPERTIES
      LABELS "mpi;${A_LABELS}" TIMEOUT ${A_TIMEOUT} PROCESSORS ${n}
      ENVIRONMENT "${DDP_MPI_TEST_ENV}")
  endforeach()
endfunction()
