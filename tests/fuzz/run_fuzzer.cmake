# Runs a libFuzzer binary for a bounded time: FUZZER (the binary), SEEDS (the committed seed
# corpus, read only), WORK (a scratch directory: new inputs and any crash go there, never into the
# source tree), SECONDS (the time budget). Any crash, leak, sanitizer report or timeout fails.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK}/corpus)
execute_process(
  COMMAND ${FUZZER} ${WORK}/corpus ${SEEDS} -max_total_time=${SECONDS} -timeout=10
          -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 -artifact_prefix=${WORK}/
  RESULT_VARIABLE status
  OUTPUT_VARIABLE out
  ERROR_VARIABLE err)
# libFuzzer reports on stderr; keep its last lines (the summary, or the crash and its input).
string(LENGTH "${err}" length)
if(length GREATER 6000)
  math(EXPR start "${length} - 6000")
  string(SUBSTRING "${err}" ${start} 6000 err)
endif()
message("${err}")
if(NOT status EQUAL 0)
  file(GLOB artifacts ${WORK}/crash-* ${WORK}/leak-* ${WORK}/timeout-* ${WORK}/oom-*)
  message(FATAL_ERROR "fuzzer exit code ${status}; inputs that failed: ${artifacts}\n"
                      "Add each to tests/fuzz/corpus/ as a regression seed once it is fixed.")
endif()
