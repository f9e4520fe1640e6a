# timeline.gp - one schematic timeline from a small data file, plots/timelines/<name>.dat, whose
# rows are "lane start end kind label" (kind 1: copies, 2: products on the tensor cores,
# 3: softmax, 4: waiting). The figures show an order of events, not measured times: what each
# schedule is worth is measured in the lessons' ablation tables.
# usage: gnuplot -e "data='plots/timelines/ring.dat'; out='x.png'; heading='...'; lanes=N;
#                    lane_tics='(\"producer\" 0, \"consumer\" 1)'" plots/timeline.gp
set terminal pngcairo size 1100, (90 + 45 * lanes) font ",10"
set output out
set title heading
set yrange [lanes - 0.5:-0.5]
eval "set ytics " . lane_tics
set ytics nomirror scale 0
set xtics format "" scale 0
set xlabel "time (schematic)"
set grid xtics lc rgb "#dddddd"
set border 3
set style fill solid 0.85 border lc rgb "white"
colour(kind) = kind == 1 ? 0x9e9e9e : kind == 2 ? 0x1f77b4 : kind == 3 ? 0xff7f0e : 0xeeeeee
ink(kind) = kind == 4 ? 0x555555 : 0xffffff
plot data using (($2 + $3) / 2):1:(($3 - $2) / 2):(0.35):(colour($4)) with boxxyerror lc rgb variable notitle, \
     '' using (($2 + $3) / 2):1:5:(ink($4)) with labels tc rgb variable font ",9" notitle
