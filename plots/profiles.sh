#!/usr/bin/env bash
# profiles.sh [PROGRAM...] - the Nsight Compute profile of every stage that the lessons quote, in one run:
# each stage (and the ablation builds its lesson profiles) at S = 4096, B = 4, H*D = 2048,
# non-causal, D = 64 and 128, every kernel of one forward pass (and of one backward pass for the
# stages that have one; stage 01 is three kernels).
#   docs/profiles/<stage>_<gpu>_ncu.txt   ncu's sections, as ncu prints them, per kernel;
#   plots/data/<gpu>_profiles.csv         selected metrics, one row per kernel and metric: the
#                                         lessons' profile tables and the roofline chart read it.
# ncu runs kernels at base clocks and replays each many times: use its durations for ratios and
# reasons, the benchmark's for speed. Needs a GPU, ncu and FLASH_STAGES_BIN (default build/bin).
# Given programs (a stage whose kernels changed), only those are profiled again: their rows of the
# CSV and their stages' pages are replaced, the other rows kept.
# Another shape, for a lesson that explains a point of the sweep: PROFILE_SEQ=S (B = 16384 / S,
# as in the sweep) and PROFILE_CAUSAL=1 change the run, and with them PROFILE_DIMS="64" and
# PROFILE_FORWARD_ONLY=1 may narrow it; its pages and metrics go beside the standard ones, tagged
# with the shape:
#   docs/profiles/<stage>_<gpu>_s<S>[_causal]_ncu.txt, plots/data/<gpu>_s<S>[_causal]_profiles.csv.
set -uo pipefail
cd "$(dirname "$0")/.."
source plots/gpu_slug.sh
seq=${PROFILE_SEQ:-4096} causal=${PROFILE_CAUSAL:-0} dims=${PROFILE_DIMS:-64 128}
forward_only=${PROFILE_FORWARD_ONLY:-0}
tag= mask=non-causal causal_flag=()
[ "$causal" = 1 ] && mask=causal causal_flag=(--causal)
[ "$seq" != 4096 ] || [ "$causal" = 1 ] && tag=_s$seq${causal_flag:+_causal}
# The standard profile is of both passes at D = 64 and 128: fewer would drop rows the lessons read.
if [ -z "$tag" ] && { [ "$dims" != "64 128" ] || [ "$forward_only" = 1 ]; }; then
    echo "profiles: PROFILE_DIMS and PROFILE_FORWARD_ONLY apply to another shape (PROFILE_SEQ, PROFILE_CAUSAL) only" >&2
    exit 2
fi
bin=${FLASH_STAGES_BIN:-build/bin}
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
[ -n "$gpu_name" ] || { echo "profiles: no NVIDIA GPU found (nvidia-smi failed)" >&2; exit 1; }
command -v ncu >/dev/null || { echo "profiles: ncu (Nsight Compute) not found" >&2; exit 1; }
slug=$(gpu_slug "$gpu_name")
commit=${FLASH_STAGES_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}  # as bench.sh
work=$(mktemp -d "${TMPDIR:-/tmp}/profiles.XXXXXX")

# The programs profiled: every stage, the ablation builds whose lesson quotes their profile, and
# the PyTorch peers the lessons compare with (sdpa_<backend>: plots/sdpa_once.py runs one forward
# and one backward pass of that backend inside the NVTX range "sdpa", and only its kernels are
# profiled).
programs=(01_naive_3pass 02_scalar_tiled 02_scalar_tiled.no_q_padding 03_online_softmax
          03_online_softmax.smem_of_04 04_smem_state 05_wmma_qk 06_wmma_pv 07_swizzle_cp_async
          07_swizzle_cp_async.no_swizzle 08_warp_specialized 09_tma_wgmma 10_fa3_schedule
          10_fa3_schedule.deterministic_dq
          sdpa_flash sdpa_cudnn)
[ $# -gt 0 ] && programs=("$@")
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis)
# Beyond the sections (which bring duration, throughputs, occupancy and its limits, and the
# stall reasons): DRAM bytes (the roofline's arithmetic intensity), shared-memory bank conflicts
# and wavefronts, and the activity of the tensor and FMA pipes.
metrics=dram__bytes_read.sum,dram__bytes_write.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum
metrics+=,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum
metrics+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,smsp__inst_executed_op_ldsm.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
metrics+=,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__throughput.avg.pct_of_peak_sustained_active

status=0
declare -A started
for program in "${programs[@]}"; do
    stage=${program%%.*}
    run=("$bin/$program") filter=()
    if [[ $program == sdpa_* ]]; then
        run=(python3 plots/sdpa_once.py "${program#sdpa_}") filter=(--nvtx --nvtx-include "sdpa/")
        python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null ||
            { echo "profiles: $program needs PyTorch with CUDA, skipped"; continue; }
    else
        [ -x "$bin/$program" ] || { echo "profiles: $bin/$program not built, skipped"; continue; }
    fi
    page=docs/profiles/${stage}_${slug}${tag}_ncu.txt
    if [ -z "${started[$stage]:-}" ]; then
        started[$stage]=1
        {
            echo "# Nsight Compute on the $gpu_name, written by plots/profiles.sh at commit $commit."
            echo "# S = $seq, B = $((16384 / seq)), H*D = 2048, $mask; every kernel of one run of the program."
            echo "# ncu runs kernels at base clocks and replays them: its durations are longer than the"
            echo "# benchmark's. The selected metrics are in plots/data/${slug}${tag}_profiles.csv."
        } >"$page"
    fi
    # A stage with a backward pass runs it after the forward: one run profiles the kernels of both.
    pass=
    [ "$forward_only" = 1 ] ||
        { "${run[@]}" --backward --batch 1 --heads 1 --seq 16 --dim 64 >/dev/null 2>&1 && pass=--backward; }
    for dim in $dims; do
        report=$work/${program}_D$dim
        args=($pass --batch $((16384 / seq)) --heads $((2048 / dim)) --seq $seq --dim $dim "${causal_flag[@]}")
        echo "profiles: $program ${args[*]}"
        if ! ncu "${filter[@]}" "${sections[@]}" --metrics "$metrics" --export "$report" --force-overwrite \
            "${run[@]}" "${args[@]}" >"$report.log" 2>&1; then
            echo "profiles: ncu failed on $program ${args[*]}:"; tail -n 20 "$report.log"; status=1; continue
        fi
        {
            echo
            echo "== $program ${args[*]}"
            ncu --import "$report.ncu-rep" --page details
        } >>"$page"
        ncu --import "$report.ncu-rep" --page raw --csv --print-units base >"$report.csv"
        python3 plots/ncu_metrics.py "$report.csv" --gpu "$gpu_name" --build "$program" --dim $dim \
            --commit "$commit" >>"$work/profiles.csv" || status=1
    done
done
mkdir -p plots/data
csv=plots/data/${slug}${tag}_profiles.csv
{
    echo "gpu,build,kernel,dim,metric,value,unit,commit"
    # With programs given, the rows of the others stay (column 2 is the build).
    if [ $# -gt 0 ] && [ -f "$csv" ]; then
        tail -n +2 "$csv" | awk -F, -v redone="$*" 'BEGIN { n = split(redone, p, " "); for (i = 1; i <= n; i++) skip[p[i]] = 1 }
                                                 !($2 in skip)'
    fi
    cat "$work/profiles.csv" 2>/dev/null
} >"$csv.new" && mv "$csv.new" "$csv"
echo "profiles: wrote $csv ($(($(wc -l <"$csv") - 1)) rows) and docs/profiles/*_${slug}${tag}_ncu.txt"
rm -rf "$work"
exit $status
