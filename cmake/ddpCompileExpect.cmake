# cmake -DCOMMAND=<;-list> -DEXPECT=pass|fail [-DFIRST_ERROR_REGEX=<regex>] -P ddpCompileExpect.cmake
# Runs a compiler command. EXPECT=pass: it must succeed (warnings are errors on the command line).
# EXPECT=fail: it must fail, and the first diagnostic line that says "error" must match
# FIRST_ERROR_REGEX, so that the readable message comes ahead of the template errors.
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
message("${all}")
if(EXPECT STREQUAL "pass")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "expected the case to compile, got exit status ${rc}")
  endif()
  return()
endif()
if(rc EQUAL 0)
  message(FATAL_ERROR "expected a compile error, but the case compiled")
endif()
string(REGEX MATCH "[^\n]*error:[^\n]*" first "${all}")
message("first error line: ${first}")
if(DEFINED FIRST_ERROR_REGEX AND NOT first MATCHES "${FIRST_ERROR_REGEX}")
  message(FATAL_ERROR "the first error does not match '${FIRST_ERROR_REGEX}'")
endif()
