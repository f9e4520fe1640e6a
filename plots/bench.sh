#!/usr/bin/env bash
# bench.sh [--parts LIST] [--merge] STAGE... - run every stage over plots/shapes.txt on the GPU
# (the forward, then the backward of the stages that have one), then the peers (plots/peers.py:
# PyTorch's SDPA backends, forward and backward, and FlashAttention-3 where it can be imported),
# the stages' ablation builds and ladder steps (plots/ablations.py), the stages that take bf16 in
# both types (bf16), and the GPU's ceilings; write plots/data/<gpu>.csv, <gpu>_ablations.csv,
# <gpu>_ladders.csv, <gpu>_bf16.csv and <gpu>_ceilings.csv and render the charts. Run it through `cmake --workflow --preset bench` (README), which builds first and
# sets FLASH_STAGES_BIN.
#
# --parts LIST (comma-separated; default sweep,peers,ablations,ladders,fp8,bf16,ceilings,overhead) runs only those
# parts, and --merge (which a subset of parts needs) puts their rows into the CSVs already there
# (plots/merge_rows.py) instead of replacing them: where one command may not run for the whole
# benchmark, build once (cmake --workflow --preset full), then run it as several commands on the
# same machine with FLASH_STAGES_BIN=build/bin, for instance `--parts sweep --merge
# 01_naive_3pass ... 05_wmma_qk`, then the other stages, then `--parts peers,ceilings --merge`
# (the peers and the ceilings take no STAGE). --peers NAMES (comma-separated) times only those
# peers (plots/peers.py --only), so that with --merge the other peers' rows stay as they were.
#
# Each measurement is checked against the float64 reference before it is timed; a stage that
# cannot run a shape (memory, or unsupported) says so and the sweep goes on. Exit status is
# non-zero if any check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source plots/gpu_slug.sh

bin=${FLASH_STAGES_BIN:-build/bin}
all_parts=sweep,peers,ablations,ladders,fp8,bf16,ceilings,overhead
parts=$all_parts merge=0 only_peers=""
while [ $# -gt 0 ]; do
    case $1 in
    --parts) parts=${2:?--parts needs a list}; shift 2 ;;
    --merge) merge=1; shift ;;
    --peers) only_peers="--only ${2:?--peers needs a list}"; shift 2 ;;
    *) break ;;
    esac
done
stages=("$@")
usage="usage: FLASH_STAGES_BIN=build/bin $0 [--parts $all_parts] [--peers NAMES] [--merge] STAGE..."
for part in ${parts//,/ }; do
    [[ ",$all_parts," == *",$part,"* ]] || { echo "bench: unknown part '$part'; $usage" >&2; exit 2; }
done
has_part() { [[ ",$parts," == *",$1,"* ]]; }
# Some parts alone would replace the CSVs with their own rows: they go in with --merge only.
for part in ${all_parts//,/ }; do
    has_part $part || [ $merge = 1 ] || { echo "bench: --parts without '$part' needs --merge; $usage" >&2; exit 2; }
done
if has_part sweep || has_part ablations || has_part ladders || has_part bf16; then
    [ ${#stages[@]} -gt 0 ] || { echo "$usage" >&2; exit 2; }
fi

if ! gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) ||
    [ -z "$gpu_name" ]; then
    echo "bench: no NVIDIA GPU found (nvidia-smi failed); the benchmark needs one." >&2
    echo "bench: the charts can still be rendered from the committed CSVs: cmake --build build --target plots" >&2
    exit 1
fi
slug=$(gpu_slug "$gpu_name")
out=plots/data/$slug.csv
tmp=$(mktemp "${TMPDIR:-/tmp}/bench.XXXXXX.csv")
# The commit measured, with -dirty where tracked files differ from it: a copy of a working tree
# with uncommitted changes, or a checkout whose .git is older than its files, says so.
export FLASH_STAGES_COMMIT=${FLASH_STAGES_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}

mapfile -t shapes < <(grep -v '^#' plots/shapes.txt | grep -v '^ *$')
echo "bench: $gpu_name, ${#stages[@]} stages x ${#shapes[@]} shapes, commit $FLASH_STAGES_COMMIT -> $out"
n=0 failures=0 start=$SECONDS
# sweep CSV DTYPE...: every stage of sweep_stages over the shapes, the forward then the backward,
# in each DTYPE one after the other at each shape (so that two types' times are seconds apart).
sweep() {
    local csv=$1 dtype stage shape pass log status label
    shift
    for pass in forward backward; do
        for stage in "${sweep_stages[@]}"; do
            for shape in "${shapes[@]}"; do
                for dtype in "$@"; do
                    read -r B H S D causal <<<"$shape"
                    flags=(--batch "$B" --heads "$H" --seq "$S" --dim "$D" --dtype "$dtype" --bench --csv "$csv")
                    [ "$causal" = 1 ] && flags+=(--causal)
                    [ $pass = backward ] && flags+=(--backward)
                    log=$("$bin/$stage" "${flags[@]}" 2>&1)
                    status=$?
                    # A forward-only stage says so at once; its backward is simply not part of the
                    # sweep.
                    [ $pass = backward ] && [ $status = 3 ] && grep -q "forward pass only" <<<"$log" && continue 3
                    n=$((n + 1))
                    label=$(printf '[%3d %4ds] %-18s %-8s %s B=%-2s H=%-2s S=%-5s D=%-3s %-10s' "$n" \
                        $((SECONDS - start)) "$stage" "$pass" "$dtype" "$B" "$H" "$S" "$D" \
                        "$([ "$causal" = 1 ] && echo causal || echo non-causal)")
                    case $status in
                    0) echo "$label $(grep '^time' <<<"$log" | sed 's/^time[^:]*: //')" ;;
                    3 | 77) echo "$label skipped: $(tail -n 1 <<<"$log" | sed "s/^$stage: //")" ;;
                    *) echo "$label FAILED (exit $status):"; sed 's/^/    /' <<<"$log"; failures=$((failures + 1)) ;;
                    esac
                done
            done
        done
    done
}
sweep_stages=("${stages[@]}")
has_part sweep && sweep "$tmp" fp16
bf16_tmp=$(mktemp "${TMPDIR:-/tmp}/bf16.XXXXXX.csv")
if has_part bf16; then
    # The stages that take bf16: the others refuse it before they look for a GPU.
    sweep_stages=()
    for stage in "${stages[@]}"; do
        "$bin/$stage" --dtype bf16 --batch 1 --heads 1 --seq 1 2>&1 | grep -q "bf16 tensors are not supported" ||
            sweep_stages+=("$stage")
    done
    # The sweep's shapes from S = 2048, where the kernels, not the launches, set the time.
    mapfile -t shapes < <(for shape in "${shapes[@]}"; do read -r _ _ S _ _ <<<"$shape"; [ "$S" -ge 2048 ] && echo "$shape"; done)
    echo "bench: ${sweep_stages[*]:-no stage given} in fp16 and bf16 at ${#shapes[@]} shapes -> plots/data/${slug}_bf16.csv"
    sweep "$bf16_tmp" fp16 bf16
fi

if has_part peers; then
    echo "bench: the peers on the same shapes (plots/peers.py), forward and backward"
    python3 plots/peers.py --csv "$tmp" --shapes plots/shapes.txt $only_peers || failures=$((failures + 1))
    python3 plots/peers.py --csv "$tmp" --shapes plots/shapes.txt --backward $only_peers || failures=$((failures + 1))
fi
merge_flag=()
[ $merge = 1 ] && merge_flag=(--merge)
if has_part ablations; then
    echo "bench: the ablation builds (plots/ablations.py)"
    python3 plots/ablations.py "${merge_flag[@]}" --csv "plots/data/${slug}_ablations.csv" "${stages[@]}" ||
        failures=$((failures + 1))
fi
if has_part ladders; then
    echo "bench: the ladder steps (plots/ablations.py --ladders)"
    python3 plots/ablations.py --ladders "${merge_flag[@]}" --csv "plots/data/${slug}_ladders.csv" "${stages[@]}" ||
        failures=$((failures + 1))
fi
if has_part fp8; then
    echo "bench: FP8 accuracy, stage 10 in fp16 and stage 11's methods (plots/fp8_accuracy.py)"
    python3 plots/fp8_accuracy.py --csv "plots/data/${slug}_fp8_accuracy.csv" || failures=$((failures + 1))
fi
overhead_tmp=$(mktemp "${TMPDIR:-/tmp}/overhead.XXXXXX.csv")
if has_part overhead; then
    echo "bench: the time per eager step at a small shape, SDPA and flash_stages (plots/overhead.py)"
    FLASH_STAGES_LIB_DIR=${FLASH_STAGES_LIB_DIR:-$bin/../lib} python3 plots/overhead.py --csv "$overhead_tmp" ||
        failures=$((failures + 1))
fi
ceilings_tmp=$(mktemp "${TMPDIR:-/tmp}/ceilings.XXXXXX.csv")
if has_part ceilings; then
    echo "bench: the GPU's ceilings (copy bandwidth, matrix-product rates)"
    python3 plots/ceilings.py --csv "$ceilings_tmp" || failures=$((failures + 1))
fi

mkdir -p plots/data
if [ $merge = 1 ]; then
    python3 plots/merge_rows.py "$tmp" "$out"
    [ -s "$bf16_tmp" ] && python3 plots/merge_rows.py "$bf16_tmp" "plots/data/${slug}_bf16.csv"
else
    { has_part sweep || has_part peers; } && mv "$tmp" "$out"
    [ -s "$bf16_tmp" ] && mv "$bf16_tmp" "plots/data/${slug}_bf16.csv"
fi
rm -f "$tmp" "$bf16_tmp"
[ -s "$ceilings_tmp" ] && mv "$ceilings_tmp" "plots/data/${slug}_ceilings.csv"
rm -f "$ceilings_tmp"
[ -s "$overhead_tmp" ] && mv "$overhead_tmp" "plots/data/${slug}_overhead.csv"
rm -f "$overhead_tmp"
[ -f "$out" ] && echo "bench: $out has $(($(wc -l <"$out") - 1)) rows; this run took $((SECONDS - start)) s"
if command -v gnuplot >/dev/null; then
    bash plots/render.sh
else
    echo "bench: gnuplot not found here; render the charts where it is: cmake --build build --target plots"
fi
[ $failures -eq 0 ] || { echo "bench: $failures measurement(s) FAILED" >&2; exit 1; }
