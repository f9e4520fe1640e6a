# training.gp - the chart of python/examples/train.py's CSV: the loss of each run per step, and
# its training throughput.
# usage: gnuplot -e "csv='plots/data/h100_training.csv'; out='plots/h100_training.png'" plots/training.gp
set terminal pngcairo size 1400,600 font "Sans,11" noenhanced
set output out
set datafile separator ","
set datafile missing "NaN"
set grid ytics mytics lc rgb "#dddddd"
gpu = system("awk -F, 'NR == 2 { print $1 }' " . csv)
ours = system("awk -F, 'NR > 1 && $2 != \"sdpa_flash\" { print $2; exit }' " . csv)
is(run, seed) = (strcol(2) eq run && $3 == seed) ? $4 : NaN
set multiplot layout 1,2 title "Copy task (best achievable loss 0), one model trained three times, " . gpu
set title "Loss on the copied half (nats, log scale)"
set xlabel "step"
set logscale y
set key top right
plot csv using (is("sdpa_flash", 0)):5 with lines lw 2 lc rgb "#1f77b4" title "SDPA flash backend, seed 0", \
     csv using (is(ours, 0)):5 with lines lw 2 dt 2 lc rgb "#d62728" title ours . ", seed 0", \
     csv using (is("sdpa_flash", 1)):5 with lines lw 1.5 lc rgb "#7f7f7f" title "SDPA flash backend, seed 1"
set title "Training throughput (tokens/s, over each logging interval)"
unset logscale y
set yrange [0:*]
set key bottom right
plot csv using (is("sdpa_flash", 0)):6 with lines lw 2 lc rgb "#1f77b4" title "SDPA flash backend, seed 0", \
     csv using (is(ours, 0)):6 with lines lw 2 dt 2 lc rgb "#d62728" title ours . ", seed 0", \
     csv using (is("sdpa_flash", 1)):6 with lines lw 1.5 lc rgb "#7f7f7f" title "SDPA flash backend, seed 1"
unset multiplot
