# Checks that documentation quotes a program's code verbatim (CUB style).
#
#   cmake -DSOURCE=<program> -DNAME=<region> -DDOC=<markdown file> -P doc_snippet.cmake
#     the lines between `// example-begin <region>` and `// example-end <region>` in SOURCE, less
#     the begin marker's indentation, must appear as they are in DOC.
#   cmake -DSOURCE=<program> -DNAME=<region> -DSWAPPED=<other region> -P doc_snippet.cmake
#     region <other region> must be region <region> with `grads, buffers)` turned into
#     `buffers, grads)`: the same loop with the joinables given the other way round.

function(read_region out name)
  file(READ "${SOURCE}" src)
  set(begin "// example-begin ${name}\n")
  string(FIND "${src}" "${begin}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${SOURCE}: no `${begin}` marker")
  endif()
  string(SUBSTRING "${src}" 0 ${at} before)
  string(FIND "${before}" "\n" line_start REVERSE)
  math(EXPR line_start "${line_start} + 1")
  math(EXPR indent_length "${at} - ${line_start}")
  string(SUBSTRING "${src}" ${line_start} ${indent_length} indent)
  string(LENGTH "${begin}" begin_length)
  math(EXPR body_start "${at} + ${begin_length}")
  string(SUBSTRING "${src}" ${body_start} -1 rest)
  string(FIND "${rest}" "\n${indent}// example-end ${name}\n" end)
  if(end EQUAL -1)
    message(FATAL_ERROR "${SOURCE}: no `// example-end ${name}` marker (at the begin marker's indentation)")
  endif()
  math(EXPR end "${end} + 1")
  string(SUBSTRING "${rest}" 0 ${end} body)
  string(REPLACE "\n${indent}" "\n" body "\n${body}")
  string(SUBSTRING "${body}" 1 -1 body)
  set(${out} "${body}" PARENT_SCOPE)
endfunction()

read_region(snippet "${NAME}")
if(DEFINED SWAPPED)
  read_region(other "${SWAPPED}")
  string(REPLACE "grads, buffers)" "buffers, grads)" want "${snippet}")
  if(NOT other STREQUAL want)
    message(FATAL_ERROR "${SOURCE}: region ${SWAPPED} is not region ${NAME} with the joinables swapped; want:\n${want}")
  endif()
  if(other STREQUAL snippet)
    message(FATAL_ERROR "${SOURCE}: region ${NAME} has no `grads, buffers)` to swap")
  endif()
  message(STATUS "${SWAPPED} is ${NAME} with the joinables swapped")
else()
  file(READ "${DOC}" doc)
  string(FIND "${doc}" "${snippet}" found)
  if(found EQUAL -1)
    message(FATAL_ERROR "${DOC} does not quote region ${NAME} of ${SOURCE} verbatim; the region is:\n${snippet}")
  endif()
  message(STATUS "${DOC} quotes region ${NAME} of ${SOURCE}")
endif()
