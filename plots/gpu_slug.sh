# gpu_slug NAME: a short file name for a GPU ("NVIDIA H100 80GB HBM3" -> "h100"): the first word
# after the vendor that contains a digit, lower-cased. Sourced by bench.sh, profiles.sh, render.sh,
# tests/gpu_session.sh and python/examples/train.py (plots/tables.py has its own bench_csvs).
gpu_slug() {
    local word
    for word in $1; do
        case "$word" in NVIDIA | nvidia | GeForce | Tesla | Quadro) continue ;; esac
        if [[ "$word" =~ [0-9] ]]; then
            printf '%s\n' "$word" | tr 'A-Z' 'a-z' | tr -cd 'a-z0-9_-'
            return
        fi
    done
    printf '%s\n' "$1" | tr 'A-Z ' 'a-z_' | tr -cd 'a-z0-9_-'
}

# bench_csvs: the benchmark's CSVs, plots/data/<gpu>.csv, one per line, without the other CSVs that
# share the folder (<gpu>_ceilings, _ablations, _ladders, _bf16, _profiles, _training, _overhead
# _llama and _fp8_accuracy).
bench_csvs() {
    local csv
    for csv in plots/data/*.csv; do
        case "$csv" in *_ceilings.csv | *_ablations.csv | *_ladders.csv | *_bf16.csv | *_profiles.csv | *_training.csv | *_overhead.csv | *_llama.csv | *_fp8_accuracy.csv) continue ;; esac
        if [ -e "$csv" ]; then printf '%s\n' "$csv"; fi
    done
}
