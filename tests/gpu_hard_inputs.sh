#!/usr/bin/env bash
# gpu_hard_inputs.sh BIN_DIR OUT_DIR - every stage on inputs that stress the checker's bounds
# without being wrong: V ~ N(40, 1) (large mean: O and dP large, dS = P (dP - delta) cancels) and
# scores of large magnitude (Q, K scaled by 2.5: scores to about +-30), at odd S, both head dims,
# causal and not, with the backward for the stages that have one. A correct kernel must pass all.
# Needs a GPU and python3 with NumPy to write the .npy files.
set -uo pipefail
bin=${1:?usage: gpu_hard_inputs.sh BIN_DIR OUT_DIR}
out=${2:?usage: gpu_hard_inputs.sh BIN_DIR OUT_DIR}
mkdir -p "$out"
runs=0 failures=0
for regime in mean40_v large_scores; do
    for seq in 77 1023; do
        for dim in 64 128; do
            dir="$out/$regime-S$seq-D$dim"
            python3 - "$dir" "$regime" "$seq" "$dim" <<'PY' || exit 1
import os, sys
import numpy as np
d, regime, S, D = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
os.makedirs(d, exist_ok=True)
rng = np.random.default_rng(S * 1000 + D)
t = {n: rng.standard_normal((2, 3, S, D)) for n in ("q", "k", "v", "do")}
if regime == "mean40_v":
    t["v"] += 40.0
else:
    t["q"] *= 2.5
    t["k"] *= 2.5
for n, x in t.items():
    np.save(os.path.join(d, n + ".npy"), x.astype(np.float16))
PY
            for exe in "$bin"/*; do
                stage=$(basename "$exe")
                [[ "$stage" == *.* ]] && continue  # ablation builds: their CTest cases cover them
                passes=("")
                "$exe" --backward --seq 1 2>&1 | grep -q "forward pass only" || passes+=(--backward)
                for pass in "${passes[@]}"; do
                    for causal in "" --causal; do
                        log=$("$exe" --load "$dir" $pass $causal 2>&1)
                        status=$?
                        runs=$((runs + 1))
                        case $status in
                        0) grep -o "largest error [^)]*of its bound" <<<"$log" | sort | tail -n 1 |
                               sed "s|^|$stage $regime S=$seq D=$dim $pass $causal: |" >>"$out/hard_inputs.log" ;;
                        77 | 3) runs=$((runs - 1)) ;;
                        *) failures=$((failures + 1)); echo "FAILED: $stage $regime S=$seq D=$dim $pass $causal"
                           sed 's/^/    /' <<<"$log" | tail -n 12 ;;
                        esac
                    done
                done
            done
        done
    done
done
echo "hard inputs: $runs runs, $failures failed"
[ $failures -eq 0 ]
