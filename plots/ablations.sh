#!/usr/bin/env bash
# ablations.sh STAGE... - time every stage that has ablation builds (stages/<stage>/ablations.txt)
# and each of those builds at S = 4096 (B = 4, H*D = 2048; D = 64 and 128, causal and not; more
# sequence lengths where the file names them in a line "# sequence lengths: ..."), in the
# passes each build changes (and at the small shape where the file names one in a line
# "# small shape: B H S D"), and write the rows to plots/data/<gpu>_ablations.csv: the lessons'
# tables "what each idea is worth" come from it. bench.sh runs it after the sweep; run alone, it
# needs FLASH_STAGES_BIN (default build/bin) to hold the built programs.
#
# Every measurement is checked against the float64 reference before it is timed (the harness
# does both); exit status is non-zero if a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source plots/gpu_slug.sh

bin=${FLASH_STAGES_BIN:-build/bin}
[ $# -gt 0 ] || { echo "usage: FLASH_STAGES_BIN=build/bin $0 STAGE..." >&2; exit 2; }
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
[ -n "$gpu_name" ] || { echo "ablations: no NVIDIA GPU found (nvidia-smi failed)" >&2; exit 1; }
out=plots/data/$(gpu_slug "$gpu_name")_ablations.csv
tmp=$(mktemp "${TMPDIR:-/tmp}/ablations.XXXXXX.csv")
export FLASH_STAGES_COMMIT=${FLASH_STAGES_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

failures=0 start=$SECONDS
time_shape() {  # time_shape PROGRAM PASS B H S D [--causal]
    local program=$1 pass=$2 flags=() log
    [ "$pass" = bwd ] && flags+=(--backward)
    if log=$("$bin/$program" "${flags[@]}" --batch "$3" --heads "$4" --seq "$5" --dim "$6" ${7:-} --bench --csv "$tmp" 2>&1); then
        printf '[%4ds] %-48s %s B=%-2s S=%-5s D=%-3s %-8s %s\n' $((SECONDS - start)) "$program" "$pass" "$3" "$5" "$6" \
            "${7:-}" "$(grep '^time' <<<"$log" | sed 's/^time[^:]*: //')"
    else
        echo "ablations: $program $pass B=$3 H=$4 S=$5 D=$6 ${7:-} FAILED:"; sed 's/^/    /' <<<"$log"
        failures=$((failures + 1))
    fi
}
time_build() {  # time_build PROGRAM PASS SEQ...
    local program=$1 pass=$2 dim causal seq
    shift 2
    for seq in "$@"; do
        for dim in 64 128; do
            # B * S = 16384 tokens and H * D = 2048, as in the sweep (B = 4 at S = 4096).
            for causal in "" --causal; do time_shape "$program" "$pass" $((16384 / seq)) $((2048 / dim)) "$seq" $dim $causal; done
        done
    done
    # The small shape, where the file names one in "# small shape: B H S D".
    if [ -n "$small" ]; then
        for causal in "" --causal; do time_shape "$program" "$pass" $small $causal; done
    fi
}

for stage in "$@"; do
    file=stages/$stage/ablations.txt
    [ -f "$file" ] || continue
    # A line "# sequence lengths: 4096 16384" times every build at each; 4096 alone otherwise.
    seqs=$(sed -n 's/^# sequence lengths: *//p' "$file"); seqs=${seqs:-4096}
    small=$(sed -n 's/^# small shape: *//p' "$file")
    base_passes=fwd
    grep -v '^#' "$file" | cut -d'|' -f2 | grep -q bwd && base_passes="fwd bwd"
    for pass in $base_passes; do time_build "$stage" $pass $seqs; done
    while IFS='|' read -r name passes _; do
        name=$(xargs <<<"$name")
        for pass in $passes; do time_build "$stage.$name" "$pass" $seqs; done
    done < <(grep -v '^#' "$file")
done

mkdir -p plots/data
mv "$tmp" "$out"
echo "ablations: wrote $out ($(($(wc -l <"$out") - 1)) rows) in $((SECONDS - start)) s"
[ $failures -eq 0 ] || { echo "ablations: $failures measurement(s) FAILED" >&2; exit 1; }
