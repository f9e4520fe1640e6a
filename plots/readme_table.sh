#!/usr/bin/env bash
# readme_table.sh --update | --check - the measured tables in README.md and in each stage's lesson
# are generated from plots/data/h100.csv, between <!-- measured:KEY:begin --> and
# <!-- measured:KEY:end --> markers; KEY is "course" in README.md and the stage name in a lesson.
# --update rewrites them; --check fails if any differs from what the CSV gives (a CTest test, so
# a table can never drift from the committed data).
#
# readme_table.sh --report CSV OUT - the same course and stage tables from another GPU's CSV
# (plots/data/<gpu>.csv), as one page OUT (plots/<gpu>.md): a learner's own measurements, beside
# the lessons' H100 tables and without touching them. plots/render.sh writes one per CSV.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: readme_table.sh --update|--check|--report CSV OUT}
csv=plots/data/h100.csv
if [ "$mode" = --report ]; then csv=${2:?usage: readme_table.sh --report CSV OUT}; fi

# The course table: each stage and peer at S = 4096 on the sweep, plus the small shape.
course_table() {
    [ -f "$csv" ] || { echo "_No H100 measurements committed yet (plots/data/h100.csv)._"; return; }
    awk -F, '
    NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
    $col["direction"] == "fwd" {
        n = $col["stage"]; S = $col["seq"]; D = $col["dim"]; c = $col["causal"]; B = $col["batch"]; H = $col["heads"]
        if (!(n in seen)) { seen[n] = 1; order[++k] = n }
        if (B * S == 16384 && H * D == 2048 && S == 4096) tf[n, D, c] = sprintf("%.1f", $col["tflops"])
        if (B == 1 && H == 8 && S == 512 && D == 64 && c == 0) small[n] = sprintf("%.1f", $col["median_us"])
        gpu = $col["gpu"]; commit[$col["commit"]] = 1
    }
    $col["direction"] == "bwd" && $col["batch"] * $col["seq"] == 16384 && $col["heads"] * $col["dim"] == 2048 && $col["seq"] == 4096 {
        n = $col["stage"]; if (!(n in bseen)) { bseen[n] = 1; border[++bk] = n }
        btf[n, $col["dim"], $col["causal"]] = sprintf("%.1f", $col["tflops"])
    }
    function v(x) { return x == "" ? "-" : x }
    END {
        print "Forward TFLOP/s at S = 4096 (B = 4, H*D = 2048) and latency of the small shape, " gpu ","
        cs = ""; for (x in commit) cs = cs (cs == "" ? "" : ", ") x
        print "from `" FILENAME "` (commit " cs "):"
        print ""
        print "| stage | D=64 | D=64 causal | D=128 | D=128 causal | B=1 H=8 S=512 D=64 (us) |"
        print "|---|---:|---:|---:|---:|---:|"
        for (i = 1; i <= k; i++) { n = order[i]
            printf "| %s | %s | %s | %s | %s | %s |\n", n, v(tf[n,64,0]), v(tf[n,64,1]), v(tf[n,128,0]), v(tf[n,128,1]), v(small[n]) }
        if (bk == 0) exit
        print ""
        print "Backward TFLOP/s at S = 4096 (FLOPs 2.5x the forward):"
        print ""
        print "| stage | D=64 | D=64 causal | D=128 | D=128 causal |"
        print "|---|---:|---:|---:|---:|"
        for (i = 1; i <= bk; i++) { n = border[i]
            printf "| %s | %s | %s | %s | %s |\n", n, v(btf[n,64,0]), v(btf[n,64,1]), v(btf[n,128,0]), v(btf[n,128,1]) }
    }' "$csv"
}

# A stage's table: its TFLOP/s over the whole sweep in one direction (fwd or bwd), with the flash
# backend beside it.
stage_table() {
    local stage=$1 direction=$2
    [ -f "$csv" ] || { echo "_No H100 measurements committed yet (plots/data/h100.csv)._"; return; }
    awk -F, -v stage="$stage" -v direction="$direction" -v csv="$csv" '
    NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
    $col["direction"] == direction && $col["batch"] * $col["seq"] == 16384 && $col["heads"] * $col["dim"] == 2048 {
        n = $col["stage"]; S = $col["seq"]; D = $col["dim"]; c = $col["causal"]
        if (n == stage || n == "sdpa_flash") { tf[n, S, D, c] = sprintf("%.2f", $col["tflops"]); seqs[S] = 1 }
        gpu = $col["gpu"]
    }
    function v(x) { return x == "" ? "skipped" : x }
    END {
        if (!(stage SUBSEP 4096 SUBSEP 64 SUBSEP 0 in tf) && !(stage SUBSEP 4096 SUBSEP 128 SUBSEP 0 in tf)) {
            print "_Not measured in `" csv "`._"; exit
        }
        name = gpu ~ /H100/ ? "the H100" : "the " gpu
        print (direction == "fwd" ? "Forward" : "Backward") " TFLOP/s on " name " (B*S = 16384, H*D = 2048), from `" csv "`; in brackets PyTorch SDPA flash:"
        print ""
        print "| S | D=64 | D=64 causal | D=128 | D=128 causal |"
        print "|---:|---:|---:|---:|---:|"
        for (S = 512; S <= 16384; S *= 2) if (S in seqs) {
            line = "| " S
            for (D = 64; D <= 128; D += 64) for (c = 0; c <= 1; c++)
                line = line " | " v(tf[stage, S, D, c]) " (" v(tf["sdpa_flash", S, D, c]) ")"
            print line " |"
        }
    }' "$csv"
}

# Stage 08's configurations (plots/stage_variants.sh): TFLOP/s at S = 4096 of the stage as built,
# of each variant, and of stage 07, all from one run.
variants_table() {
    local file=plots/data/h100_stage08_variants.csv
    [ -f "$file" ] || { echo "_No H100 variant measurements committed yet ($file)._"; return; }
    awk -F, '
    NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
    {
        n = $col["stage"]; d = $col["direction"]; key = n SUBSEP d
        if (!(key in seen)) { seen[key] = 1; order[++k] = key }
        tf[key, $col["dim"], $col["causal"]] = sprintf("%.1f", $col["tflops"]); commit = $col["commit"]; gpu = $col["gpu"]
    }
    function v(x) { return x == "" ? "-" : x }
    END {
        print "TFLOP/s at S = 4096 (B = 4, H*D = 2048) on the " gpu ", one run of `plots/stage_variants.sh` (commit " commit "), from `" FILENAME "`:"
        print ""
        print "| build | pass | D=64 | D=64 causal | D=128 | D=128 causal |"
        print "|---|---|---:|---:|---:|---:|"
        for (i = 1; i <= k; i++) { split(order[i], p, SUBSEP)
            printf "| %s | %s | %s | %s | %s | %s |\n", p[1], p[2], v(tf[order[i],64,0]), v(tf[order[i],64,1]), v(tf[order[i],128,0]), v(tf[order[i],128,1]) }
    }' "$file"
}

# The GPU's measured ceilings (plots/ceilings.py).
ceilings_table() {
    local file=plots/data/h100_ceilings.csv
    [ -f "$file" ] || { echo "_No H100 ceilings committed yet ($file)._"; return; }
    awk -F, 'NR == 1 { next }
    { gpu = $1; name[NR] = $2; value[NR] = $3; unit[NR] = $4; commit = $5 }
    END {
        print "Measured on the " gpu " by `plots/ceilings.py` (commit " commit "), from `" FILENAME "`:"
        print ""
        print "| ceiling | value |"
        print "|---|---:|"
        for (i = 2; i <= NR; i++) printf "| %s | %s %s |\n", name[i], value[i], unit[i]
    }' "$file"
}

# Replace the block KEY in FILE with stdin; print the new file to stdout.
replace_block() {
    local file=$1 key=$2 body
    body=$(cat)
    awk -v key="$key" -v body="$body" '
        $0 == "<!-- measured:" key ":begin -->" { print; print body; skipping = 1; next }
        $0 == "<!-- measured:" key ":end -->" { skipping = 0 }
        !skipping { print }' "$file"
}

# The training run of python/examples/train.py (plots/data/h100_training.csv): per run, the loss at
# the last logged step, the mean of the last ten logged losses, and the median of the logged
# throughputs; then flash_stages' throughput over each SDPA run's.
training_table() {
    local file=plots/data/h100_training.csv
    [ -f "$file" ] || { echo "_No training run committed yet ($file)._"; return; }
    awk -F, '
    NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
    {
        r = $col["run"] " seed " $col["seed"]; gpu = $col["gpu"]
        if (!(r in seen)) { seen[r] = 1; order[++k] = r }
        n[r]++; loss[r, n[r]] = $col["loss"]; last_step[r] = $col["step"]
        if ($col["tokens_per_s"] != "") rate[r, ++m[r]] = $col["tokens_per_s"] + 0
    }
    function median(r,    i, j, t, a) {
        for (i = 1; i <= m[r]; i++) a[i] = rate[r, i]
        for (i = 2; i <= m[r]; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
        return m[r] % 2 ? a[(m[r] + 1) / 2] : (a[m[r] / 2] + a[m[r] / 2 + 1]) / 2
    }
    END {
        print "One run of `python/examples/train.py` on the " gpu ", from `" FILENAME "`:"
        print ""
        print "| run | loss at the last step | mean of the last 10 logged losses | median tokens/s |"
        print "|---|---:|---:|---:|"
        for (i = 1; i <= k; i++) { r = order[i]; s = 0
            for (j = n[r] - 9; j <= n[r]; j++) s += loss[r, j]
            med[r] = median(r)
            printf "| %s | %.5f (step %d) | %.5f | %.0f |\n", r, loss[r, n[r]], last_step[r], s / 10, med[r] }
        for (i = 1; i <= k; i++) if (order[i] !~ /^sdpa/) ours = order[i]
        print ""
        line = "Throughput of " ours " over SDPA flash:"
        for (i = 1; i <= k; i++) if (order[i] ~ /^sdpa/) line = line sprintf(" %.3fx (%s)", med[ours] / med[order[i]], order[i])
        print line "."
    }' "$file"
}

# The page of --report: every table of the README and the lessons, from $csv.
report_page() {
    local gpu commit
    gpu=$(awk -F, 'NR == 2 { print $1 }' "$csv")
    echo "# The course on the $gpu"
    echo
    echo "Generated by \`plots/readme_table.sh --report\` from \`$csv\`: the tables of the"
    echo "[course README](../README.md) and of each lesson, from this GPU's own run of"
    echo "\`cmake --workflow --preset bench\`. The lessons' prose discusses the H100's numbers."
    echo
    echo "## All stages"
    echo
    course_table
    for lesson in stages/*/README.md; do
        local stage
        stage=$(basename "$(dirname "$lesson")")
        echo
        echo "## [$stage](../$lesson)"
        echo
        stage_table "$stage" fwd
        if grep -qF "<!-- measured:$stage:bwd:begin -->" "$lesson"; then
            echo
            stage_table "$stage" bwd
        fi
    done
}
if [ "$mode" = --report ]; then
    report_page >"${3:?usage: readme_table.sh --report CSV OUT}"
    exit 0
fi

status=0
process() {  # process FILE KEY (table on stdin)
    local file=$1 key=$2 new
    # A file without the block (a lesson with no measurements yet) still reads the table, so
    # the generator never dies of SIGPIPE, which pipefail would turn into a failed check.
    grep -qF "<!-- measured:$key:begin -->" "$file" || { cat >/dev/null; return 0; }
    new=$(replace_block "$file" "$key")
    if [ "$mode" = --update ]; then
        printf '%s\n' "$new" >"$file"
    elif [ "$new" != "$(cat "$file")" ]; then
        echo "readme_table: the measured table '$key' in $file differs from $csv; run plots/readme_table.sh --update" >&2
        status=1
    fi
}
course_table | process README.md course
ceilings_table | process docs/h100.md ceilings
variants_table | process stages/08_warp_specialized/README.md 08_warp_specialized:variants
training_table | process README.md training
training_table | process python/README.md training
for lesson in stages/*/README.md; do
    stage=$(basename "$(dirname "$lesson")")
    stage_table "$stage" fwd | process "$lesson" "$stage"
    stage_table "$stage" bwd | process "$lesson" "$stage:bwd"
done
# Each GPU's report page, plots/<gpu>.md, from its CSV.
source plots/gpu_slug.sh
for data in $(bench_csvs); do
    page=plots/$(basename "$data" .csv).md
    new=$(mktemp)
    bash "$0" --report "$data" "$new"
    if [ "$mode" = --update ]; then
        mv "$new" "$page"
    elif ! cmp -s "$new" "$page"; then
        echo "readme_table: $page differs from what $data gives; run plots/readme_table.sh --update" >&2
        status=1
        rm -f "$new"
    else
        rm -f "$new"
    fi
done
[ "$mode" = --check ] && [ $status = 0 ] && echo "readme_table: README, lesson tables and report pages match plots/data"
exit $status
