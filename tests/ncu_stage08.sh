#!/usr/bin/env bash
# ncu_stage08.sh BIN_DIR OUT_FILE - the Nsight Compute profile stage 08's lesson quotes: stage 07
# and stage 08 forward side by side (S = 4096, B = 4, H*D = 2048, non-causal, D = 64 and 128),
# then stage 08's backward kernels (D = 64 and 128). ncu runs kernels at base clocks, so its
# durations are longer than the benchmark's: use it for ratios and reasons.
set -uo pipefail
bin=${1:?usage: ncu_stage08.sh BIN_DIR OUT_FILE}
out=${2:?usage: ncu_stage08.sh BIN_DIR OUT_FILE}
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section ComputeWorkloadAnalysis)
: >"$out"
for dim in 64 128; do
    heads=$((2048 / dim))
    for stage in 07_swizzle_cp_async 08_warp_specialized; do
        echo "== $stage forward, B=4 H=$heads S=4096 D=$dim" >>"$out"
        ncu "${sections[@]}" --kernel-name regex:'swizzle_cp_async_kernel|warp_specialized_forward' \
            --launch-count 1 "$bin/$stage" --batch 4 --heads $heads --seq 4096 --dim $dim >>"$out" 2>&1
    done
    echo "== 08_warp_specialized backward, B=4 H=$heads S=4096 D=$dim" >>"$out"
    ncu "${sections[@]}" --kernel-name regex:'backward_dk_dv|backward_dq' --launch-count 2 \
        "$bin/08_warp_specialized" --backward --batch 4 --heads $heads --seq 4096 --dim $dim >>"$out" 2>&1
done
grep -E "^==|Duration|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Warp Cycles Per Issued" "$out"
