#!/usr/bin/env bash
# gpu_session.sh [test|quick|ablations|bench|all] - what one call on a lent GPU machine runs: build
# (for the local GPU: CMakeLists.txt finds it), then
#   test:     every CTest test (the hard inputs and many heads among them: labels hard and
#             many_heads), and compute-sanitizer memcheck, racecheck and synccheck on a small odd
#             causal shape per stage, forward and backward;
#   quick:    test, plus each stage timed at S = 4096;
#   ablations: test, plus plots/ablations.py (every ablation build) and
#             plots/profiles.sh (Nsight Compute profile of every stage);
#   bench:    plots/bench.sh over every shape (writes plots/data/<gpu>.csv);
#   all:      test and bench.
# Logs go to $OUT (or ./gpu_out), so they come back even when a step fails.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-test}
out=${OUT:-gpu_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$out/gpu.txt"
nvcc --version | tail -n 2 | tee -a "$out/gpu.txt"

cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASH_STAGES_ABLATION_BUILDS=ON >"$out/build.log" 2>&1 &&
    cmake --build build-gpu >>"$out/build.log" 2>&1 || { tail -n 40 "$out/build.log"; exit 1; }
stages=$(ls build-gpu/bin | grep -v '\.')  # the stages, not their ablation builds (<stage>.<name>)

run_tests() {
ctest --test-dir build-gpu -j 8 --output-on-failure >"$out/ctest.log" 2>&1
grep -E "tests passed|tests failed|Skipped|Failed|\*\*\*" "$out/ctest.log" | tail -n 20

: >"$out/sanitizer.log"
# SANITIZE_STAGES narrows the sanitizer runs to the stages a change touched (default: all).
for stage in ${SANITIZE_STAGES:-$stages}; do
    for pass in "" --backward; do
        # forward-only stages: no backward to check
        if [ -n "$pass" ]; then
            probe=$(build-gpu/bin/$stage --backward --seq 1 2>&1)
            grep -q "forward pass only" <<<"$probe" && continue
        fi
        for dim in 64 128; do
            for tool in memcheck racecheck synccheck; do
                echo "== $stage $tool $pass (B=2 H=3 S=333 D=$dim causal)" >>"$out/sanitizer.log"
                compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/bin/$stage $pass \
                    --batch 2 --heads 3 --seq 333 --dim $dim --causal >>"$out/sanitizer.log" 2>&1
                echo "exit $?" >>"$out/sanitizer.log"
            done
        done
    done
done
# One line per run: what ran, the tool's summary, the exit status.
awk '/^== / { run = $0 } /ERROR SUMMARY|RACECHECK SUMMARY/ { sub(/^=+ */, ""); summary = $0 }
     /^exit / { print run " | " summary " | " $0 }' "$out/sanitizer.log" >"$out/sanitizer_summary.txt"
grep -c "| exit 0$" "$out/sanitizer_summary.txt" | sed 's/^/sanitizer runs with exit 0: /'
grep -v "| exit 0$" "$out/sanitizer_summary.txt" || true
}
[ "$mode" = bench ] || run_tests

export FLASH_STAGES_COMMIT=${FLASH_STAGES_COMMIT:-unknown}
if [ "$mode" = bench ] || [ "$mode" = all ]; then
    FLASH_STAGES_BIN=build-gpu/bin bash plots/bench.sh $stages 2>&1 | tee "$out/bench.log"
    cp plots/data/*.csv "$out/"
elif [ "$mode" = ablations ]; then
    source plots/gpu_slug.sh
    csv=plots/data/$(gpu_slug "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)")_ablations.csv
    FLASH_STAGES_BIN=build-gpu/bin python3 plots/ablations.py --csv "$csv" $stages 2>&1 | tee "$out/ablations.log"
    FLASH_STAGES_BIN=build-gpu/bin bash plots/profiles.sh 2>&1 | tee "$out/profiles.log"
    cp plots/data/*_ablations.csv plots/data/*_profiles.csv "$out/" 2>/dev/null
    mkdir -p "$out/profiles" && cp docs/profiles/*.txt "$out/profiles/"
elif [ "$mode" = quick ]; then
    for stage in $stages; do
        for shape in "4 32 4096 64" "4 16 4096 128"; do
            read -r B H S D <<<"$shape"
            build-gpu/bin/$stage --batch $B --heads $H --seq $S --dim $D --bench --iters 10 | grep -E "^time|FAIL"
        done
    done 2>&1 | tee "$out/quick.log"
fi
