#!/usr/bin/env bash
# render.sh [--check OUTDIR] - draw the charts of every plots/data/<gpu>.csv, and the lessons'
# schematic timelines (plots/timelines/), with gnuplot.
# Default: into plots/<gpu>_*.png, and refresh the measured table in README.md from h100.csv.
# --check OUTDIR: draw into OUTDIR only and fail unless every chart came out (a CTest test).
# Needs gnuplot, not a GPU. Exit 77 (CTest's skip) when gnuplot is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
outdir=plots check=0
if [ "${1:-}" = "--check" ]; then check=1 outdir=${2:?usage: render.sh --check OUTDIR}; fi
command -v gnuplot >/dev/null || { echo "render: gnuplot not found; skipped"; exit 77; }
mkdir -p "$outdir"
shopt -s nullglob
source plots/gpu_slug.sh
mapfile -t csvs < <(bench_csvs)
[ ${#csvs[@]} -gt 0 ] || { echo "render: no CSV in plots/data" >&2; exit 1; }
for csv in "${csvs[@]}"; do
    slug=$(basename "$csv" .csv)
    tables=$(mktemp -d)
    awk -v dir="$tables" -f plots/prepare.awk "$csv"
    gpu=$(awk -F, 'NR == 2 { print $1 }' "$csv")
    gnuplot -e "dir='$tables'; out='$outdir/$slug'; gpu='$gpu'" plots/charts.gp
    rm -r "$tables"
    for chart in progression seqlen speedup backward; do
        [ -s "$outdir/${slug}_$chart.png" ] || { echo "render: $outdir/${slug}_$chart.png missing" >&2; exit 1; }
        echo "render: $outdir/${slug}_$chart.png"
    done
done
# The roofline of each GPU that has a profile (plots/profiles.sh) and ceilings.
for profiles in plots/data/*_profiles.csv; do
    slug=$(basename "$profiles" _profiles.csv)
    ceilings=plots/data/${slug}_ceilings.csv
    [ -f "$ceilings" ] && [ -f "plots/data/$slug.csv" ] || continue
    points=$(mktemp)
    python3 plots/tables.py --roofline "plots/data/$slug.csv" >"$points"
    read -r bandwidth tc simt < <(awk -F, '$2 == "copy_bandwidth" { b = $3 } $2 == "fp16_tensor_core_matmul" { t = $3 }
        $2 == "fp32_simt_matmul" { s = $3 } END { print b, t, s }' "$ceilings")
    gpu=$(awk -F, 'NR == 2 { print $1 }' "$ceilings")
    chart=$outdir/${slug}_roofline.png
    gnuplot -e "data='$points'; out='$chart'; gpu='$gpu'; bandwidth=$bandwidth; tc=$tc; simt=$simt" plots/roofline.gp
    rm -f "$points"
    [ -s "$chart" ] || { echo "render: $chart missing" >&2; exit 1; }
    echo "render: $chart"
done
# The runs of python/examples/train.py and llama.py, one chart per GPU each (plots/<kind>.gp).
for kind in training llama; do
    for csv in plots/data/*_$kind.csv; do
        chart=$outdir/$(basename "$csv" .csv).png
        gnuplot -e "csv='$csv'; out='$chart'" plots/$kind.gp
        [ -s "$chart" ] || { echo "render: $chart missing" >&2; exit 1; }
        echo "render: $chart"
    done
done
# Stage 11's accuracy experiment, one chart per GPU that ran it (plots/fp8_accuracy.py).
for csv in plots/data/*_fp8_accuracy.csv; do
    chart=$outdir/$(basename "$csv" .csv).png
    points=$(mktemp)
    python3 plots/tables.py --fp8-accuracy "$csv" >"$points"
    gpu=$(awk -F, 'NR == 2 { print $1 }' "$csv")
    gnuplot -e "data='$points'; out='$chart'; gpu='$gpu'" plots/fp8_accuracy.gp
    rm -f "$points"
    [ -s "$chart" ] || { echo "render: $chart missing" >&2; exit 1; }
    echo "render: $chart"
done
# The schematic timelines of the lessons, one per plots/timelines/<name>.dat: its "# title:" and
# "# lanes:" lines name the figure and its rows.
for data in plots/timelines/*.dat; do
    chart=$outdir/timeline_$(basename "$data" .dat).png
    heading=$(sed -n 's/^# title: //p' "$data")
    IFS='|' read -ra lanes <<<"$(sed -n 's/^# lanes: //p' "$data")"
    tics="("
    for i in "${!lanes[@]}"; do tics+="\"${lanes[$i]}\" $i, "; done
    gnuplot -e "data='$data'; out='$chart'; heading='$heading'; lanes=${#lanes[@]}; lane_tics='${tics%, })'" \
        plots/timeline.gp
    [ -s "$chart" ] || { echo "render: $chart missing" >&2; exit 1; }
    echo "render: $chart"
done
[ $check = 1 ] || python3 plots/tables.py --update
