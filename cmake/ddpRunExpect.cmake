# cmake -DCOMMAND=<;-list> -DEXPECT_EXIT=zero|nonzero -DEXPECT_REGEX=<regex> -P ddpRunExpect.cmake
# Runs a command and checks both its exit status and its combined output: for tests where the
# expected outcome is a clean failure (a clear error and a non-zero exit, never a hang).
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
message("${all}")
if(EXPECT_EXIT STREQUAL "zero" AND NOT rc EQUAL 0)
  message(FATAL_ERROR "expected exit status 0, got ${rc}")
elseif(EXPECT_EXIT STREQUAL "nonzero" AND rc EQUAL 0)
  message(FATAL_ERROR "expected a non-zero exit status, got 0")
endif()
if(DEFINED EXPECT_REGEX AND NOT all MATCHES "${EXPECT_REGEX}")
  message(FATAL_ERROR "output does not match '${EXPECT_REGEX}'")
endif()
