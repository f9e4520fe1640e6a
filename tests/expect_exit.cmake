# Run COMMAND (a ;-list) and require exit code CODE and output matching REGEX: error paths of the
# command line are tested for their exact exit code, not just "non-zero".
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT "${status}" STREQUAL "${CODE}")
  message(FATAL_ERROR "exit code ${status}, expected ${CODE}\nstdout:\n${out}\nstderr:\n${err}")
endif()
if(NOT "${out}${err}" MATCHES "${REGEX}")
  message(FATAL_ERROR "output does not match '${REGEX}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
message(STATUS "exit code ${status} and message as expected")
