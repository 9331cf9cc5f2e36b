# Helpers for the project's own tests, examples and benchmarks (never exported).

# ddp_dev_flags(target): warnings (as errors) and sanitizers, on our own targets only.
add_library(ddp_dev_flags INTERFACE)
# GCC 12 warns -Wrestrict inside libstdc++'s std::string concatenation at -O3, a known false
# positive of that version: it stays a warning there, so Release builds pass with -Werror.
target_compile_options(ddp_dev_flags INTERFACE -Wall -Wextra -Wpedantic
  $<$<BOOL:${DDP_WARNINGS_AS_ERRORS}>:-Werror>
  $<$<AND:$<CXX_COMPILER_ID:GNU>,$<VERSION_LESS:$<CXX_COMPILER_VERSION>,13>>:-Wno-error=restrict>)
if(DDP_SANITIZE)
  list(JOIN DDP_SANITIZE "," _ddp_san)
  # Line tables for the sanitizers' reports where the build type has no debug information; a
  # build type with -g keeps its own level.
  target_compile_options(ddp_dev_flags INTERFACE -fsanitize=${_ddp_san} -fno-omit-frame-pointer
    $<$<CONFIG:Release,MinSizeRel>:-g1>)
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

# Time limits: each test's TIMEOUT is a small multiple of its normal run time in an optimised
# build on a 2-core machine. Sanitizer and Debug builds run several times slower, so
# ddp_scale_test_timeouts() (called once, at the end of the top-level CMakeLists.txt) multiplies
# every limit by DDP_TEST_TIMEOUT_SCALE (default: 5 with sanitizers, 2 for Debug, else 1).
if(NOT DEFINED DDP_TEST_TIMEOUT_SCALE)
  if(DDP_SANITIZE)
    set(DDP_TEST_TIMEOUT_SCALE 5)
  elseif(CMAKE_BUILD_TYPE STREQUAL "Debug")
    set(DDP_TEST_TIMEOUT_SCALE 2)
  else()
    set(DDP_TEST_TIMEOUT_SCALE 1)
  endif()
endif()
set(DDP_TEST_TIMEOUT_SCALE ${DDP_TEST_TIMEOUT_SCALE} CACHE STRING "Multiplier for every test's time limit")

# Every multi-process run goes through scripts/ddp-run: it returns the ranks' result as soon as
# they have all exited, kills an mpiexec stuck in Open MPI 4.1's teardown, and kills the whole job
# at its own deadline, a few seconds before ctest's (docs/launching.md).
set(DDP_RUN "${PROJECT_SOURCE_DIR}/scripts/ddp-run")

# ddp_mpi_command(<out-var> <ranks> [TIMEOUT <s>] <program> [args...]): the command line that runs
# <program> on <ranks> ranks. With TIMEOUT (the test's ctest timeout), ddp-run stops the job
# 5 s earlier, naming the ranks still running (both limits scale with DDP_TEST_TIMEOUT_SCALE).
function(ddp_mpi_command out ranks)
  set(args ${ARGN})
  set(limit 0)
  list(GET args 0 first)
  if(first STREQUAL "TIMEOUT")
    list(GET args 1 t)
    list(REMOVE_AT args 0 1)
    math(EXPR limit "${t} * ${DDP_TEST_TIMEOUT_SCALE} - 5")
    if(limit LESS 5)
      set(limit 5)
    endif()
  endif()
  set(${out} ${DDP_RUN} --np ${ranks} --timeout ${limit} --grace 5 --mpiexec ${MPIEXEC_EXECUTABLE}
      --mpi-flags "${DDP_MPIEXEC_OVERSUBSCRIBE} ${MPIEXEC_PREFLAGS}" ${args} ${MPIEXEC_POSTFLAGS} PARENT_SCOPE)
endfunction()

# ddp_add_mpi_test(<name> COMMAND <exe-and-args...> RANKS <n...> [LABELS ...] [TIMEOUT s]
#                  [EXPECT_EXIT zero|nonzero|any] [EXPECT_REGEX <regex>])
# registers <name>.np<N> for each N, run through ddp-run with the environment above. TIMEOUT is
# the bound for the largest rank count (tests run one at a time, ranks oversubscribe 2 cores).
# With EXPECT_EXIT or EXPECT_REGEX the run goes through ddpRunExpect.cmake, which checks the
# job's exit status (default: zero) and that the combined output matches the regex: for runs
# whose expected outcome is a clean failure.
function(ddp_add_mpi_test name)
  cmake_parse_arguments(A "" "TIMEOUT;EXPECT_EXIT;EXPECT_REGEX" "COMMAND;RANKS;LABELS" ${ARGN})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 30)
  endif()
  ddp_scale_test_timeouts()
  foreach(n IN LISTS A_RANKS)
    ddp_mpi_command(cmd ${n} TIMEOUT ${A_TIMEOUT} ${A_COMMAND})
    if(DEFINED A_EXPECT_EXIT OR DEFINED A_EXPECT_REGEX)
      set(expect_exit zero)
      if(DEFINED A_EXPECT_EXIT)
        set(expect_exit ${A_EXPECT_EXIT})
      endif()
      set(expect_regex "")
      if(DEFINED A_EXPECT_REGEX)
        set(expect_regex "-DEXPECT_REGEX=${A_EXPECT_REGEX}")
      endif()
      # The launcher command stays one argument (a ;-list) for ddpRunExpect.cmake.
      add_test(NAME ${name}.np${n}
               COMMAND ${CMAKE_COMMAND} "-DCOMMAND=${cmd}" -DEXPECT_EXIT=${expect_exit} ${expect_regex}
                       -P ${PROJECT_SOURCE_DIR}/cmake/ddpRunExpect.cmake)
    else()
      add_test(NAME ${name}.np${n} COMMAND ${cmd})
    endif()
    set_tests_properties(${name}.np${n} PROPERTIES
      LABELS "mpi;${A_LABELS}" TIMEOUT ${A_TIMEOUT} PROCESSORS ${n}
      ENVIRONMENT "${DDP_MPI_TEST_ENV}")
  endforeach()
endfunction()

# ddp_add_hosts_test(<name> COMMAND <exe-and-args...> SHAPES <HxR...> [TIMEOUT s] [LINK_RATE r]
#                    [HOSTS_ONLY]) registers <name>.hosts<H>x<R> for each shape: the job across H
# test hosts of R ranks each, made for it by `ddp-run --hosts` (network namespaces, real TCP
# between them; docs/launching.md), label `hosts`. HOSTS_ONLY runs the program once beside the
# hosts (it places its own processes on them). Exit 77 (skipped) where hosts cannot be made.
function(ddp_add_hosts_test name)
  cmake_parse_arguments(A "HOSTS_ONLY" "TIMEOUT;LINK_RATE" "COMMAND;SHAPES" ${ARGN})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 60)
  endif()
  ddp_scale_test_timeouts()
  math(EXPR limit "${A_TIMEOUT} * ${DDP_TEST_TIMEOUT_SCALE} - 5")
  set(extra "")
  if(A_LINK_RATE)
    list(APPEND extra --link-rate ${A_LINK_RATE})
  endif()
  if(A_HOSTS_ONLY)
    list(APPEND extra --hosts-only)
  endif()
  foreach(shape IN LISTS A_SHAPES)
    string(REPLACE "x" ";" hr "${shape}")
    list(GET hr 0 hosts)
    list(GET hr 1 per_host)
    math(EXPR ranks "${hosts} * ${per_host}")
    add_test(NAME ${name}.hosts${shape}
             COMMAND ${DDP_RUN} --hosts ${hosts} --ranks-per-host ${per_host} ${extra} --timeout ${limit}
                     --grace 5 --mpiexec ${MPIEXEC_EXECUTABLE}
                     --mpi-flags "${DDP_MPIEXEC_OVERSUBSCRIBE} ${MPIEXEC_PREFLAGS}" ${A_COMMAND} ${MPIEXEC_POSTFLAGS})
    set_tests_properties(${name}.hosts${shape} PROPERTIES
      LABELS hosts TIMEOUT ${A_TIMEOUT} PROCESSORS ${ranks} SKIP_RETURN_CODE 77
      ENVIRONMENT "${DDP_MPI_TEST_ENV}")
  endforeach()
endfunction()

# ddp_scale_test_timeouts(): at the end of the calling directory's CMakeLists.txt, multiply the
# TIMEOUT of every test registered there by DDP_TEST_TIMEOUT_SCALE (set_tests_properties reaches
# only the current directory's tests, hence one deferred call per directory).
function(ddp_scale_test_timeouts)
  if(DDP_TEST_TIMEOUT_SCALE EQUAL 1)
    return()
  endif()
  get_property(done DIRECTORY PROPERTY DDP_TIMEOUT_SCALING)
  if(NOT done)
    set_property(DIRECTORY PROPERTY DDP_TIMEOUT_SCALING ON)
    cmake_language(DEFER CALL _ddp_scale_timeouts_now)
  endif()
endfunction()
function(_ddp_scale_timeouts_now)
  get_property(tests DIRECTORY PROPERTY TESTS)
  foreach(t IN LISTS tests)
    get_test_property(${t} TIMEOUT limit)
    if(limit)
      math(EXPR limit "${limit} * ${DDP_TEST_TIMEOUT_SCALE}")
      set_tests_properties(${t} PROPERTIES TIMEOUT ${limit})
    endif()
  endforeach()
endfunction()
