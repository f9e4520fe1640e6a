# gpu_slug NAME: a short file name for a GPU ("NVIDIA H100 80GB HBM3" -> "h100"): the first word
# after the vendor that contains a digit, lower-cased. Sourced by bench.sh and sdpa_peers.py's caller.
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
