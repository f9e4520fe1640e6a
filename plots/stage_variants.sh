#!/usr/bin/env bash
# stage_variants.sh BUILD_DIR - build stage 08 in the configurations its lesson compares (each a
# set of -D values for the knobs at the top of forward.cu and backward.cu), check each on odd
# shapes, time each at S = 4096 beside the stage itself and stage 07, and write the rows to
# plots/data/<gpu>_stage08_variants.csv. Needs a GPU and a configured, built BUILD_DIR (for the
# harness objects).
set -uo pipefail
cd "$(dirname "$0")/.."
source plots/gpu_slug.sh
build=${1:?usage: stage_variants.sh BUILD_DIR}
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
out=plots/data/$(gpu_slug "$gpu_name")_stage08_variants.csv
tmp=$(mktemp "${TMPDIR:-/tmp}/variants.XXXXXX.csv")
export FLASH_STAGES_COMMIT=${FLASH_STAGES_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$build/variants"

# name | -D flags | passes (fwd, bwd or both)
variants=(
    "c3_b3|-DCONSUMERS=3 -DMIN_BLOCKS=3 -DKEY_TILE_D128=64 -DSTAGES_D128=2|fwd"
    "c3_b2|-DCONSUMERS=3 -DMIN_BLOCKS=2 -DKEY_TILE_D128=64 -DSTAGES_D128=2|fwd"
    "c4_b2|-DCONSUMERS=4 -DMIN_BLOCKS=2 -DKEY_TILE_D128=32 -DSTAGES_D128=3|fwd"
    "c4_b1|-DCONSUMERS=4 -DMIN_BLOCKS=1 -DKEY_TILE_D128=64 -DSTAGES_D128=2|fwd"
    "c6_k32_stages3|-DCONSUMERS=6 -DSTAGES_D64=3 -DKEY_TILE_D128=32 -DSTAGES_D128=3|fwd"
    "c7_stages2|-DSTAGES_D64=2|fwd"
    "bwd_scalar_atomics|-DVECTOR_ATOMICS=0|bwd"
    "bwd_64_keys|-DDKDV_WARPS=4|bwd"
    "bwd_k_from_smem|-DK_FRAGS_IN_REGS_D64=0|bwd"
    "bwd_deterministic_dq|-DATOMIC_DQ=0|bwd"
    "bwd_deterministic_dq_one_row_tile|-DATOMIC_DQ=0 -DQ_TILES_D128=1|bwd"
    "bwd_deterministic_dq_two_row_tiles|-DATOMIC_DQ=0 -DQ_TILES_D64=2|bwd"
)
harness=$(find "$build" -name 'harness.c.o' | head -n 1)
host_lib=$(find "$build" -name 'libattn_host.a' | head -n 1)
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d .)

run() {  # run EXE VARIANT PASS: odd-shape checks, then S = 4096 timings
    local exe=$1 variant=$2 pass=$3 flags=()
    [ "$pass" = bwd ] && flags+=(--backward)
    for dim in 64 128; do
        for causal in "" --causal; do
            "$exe" "${flags[@]}" --batch 3 --heads 5 --seq 1000 --dim $dim $causal >/dev/null ||
                { echo "variants: $variant D=$dim $causal FAILED its check" >&2; return 1; }
            local heads=$((2048 / dim))
            FLASH_STAGES_VARIANT=$variant "$exe" "${flags[@]}" --batch 4 --heads $heads --seq 4096 --dim $dim \
                $causal --bench --csv "$tmp" | grep -E '^time' | sed "s/^/$variant D=$dim $causal $pass: /"
        done
    done
}

for pass in fwd bwd; do run "$build/bin/08_warp_specialized" "" $pass; done
run "$build/bin/07_swizzle_cp_async" "" fwd
for entry in "${variants[@]}"; do
    IFS='|' read -r name defines passes <<<"$entry"
    exe=$build/variants/08_warp_specialized.$name
    # shellcheck disable=SC2086
    nvcc -std=c++17 -O3 -lineinfo -arch=sm_$arch -Icommon $defines stages/08_warp_specialized/*.cu \
        "$harness" "$host_lib" -Xcompiler -fopenmp -lm -o "$exe" || { echo "variants: $name did not build" >&2; continue; }
    for pass in fwd bwd; do
        [ "$passes" = "$pass" ] || [ "$passes" = both ] || continue
        run "$exe" "$name" $pass
    done
done
mkdir -p plots/data
mv "$tmp" "$out"
echo "variants: wrote $out ($(($(wc -l <"$out") - 1)) rows)"
