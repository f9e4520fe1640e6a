# Compile SOURCES for sm_ARCH with ptxas -v and keep its report (registers, shared memory, spill
# bytes per kernel) in OUTPUT. Run by the build, one file per stage; lessons quote these files.
separate_arguments(sources NATIVE_COMMAND "${SOURCES}")
set(report "")
foreach(src IN LISTS sources)
  execute_process(
    COMMAND ${NVCC} -std=c++17 -O3 -gencode=arch=compute_${ARCH},code=sm_${ARCH} -cubin -o /dev/null -I${INCLUDE}
            -Xptxas -v ${src}
    RESULT_VARIABLE status
    OUTPUT_VARIABLE out
    ERROR_VARIABLE err)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "ptxas report failed for ${src}:\n${err}")
  endif()
  string(APPEND report "${out}${err}")
endforeach()
file(WRITE ${OUTPUT} "${report}")
