# training.gp - the chart of python/examples/train.py's CSV: the loss of each run per step, the
# last third of it magnified (where the runs' final losses are compared), and each run's training
# throughput. Any number of runs: one line each, SDPA's solid in blues and greys, flash_stages'
# dashed in reds, so that the two kernels read as two groups however many seeds there are.
# usage: gnuplot -e "csv='plots/data/h100_training.csv'; out='plots/h100_training.png'" plots/training.gp
set terminal pngcairo size 1800,600 font "Sans,11" noenhanced
set output out
set datafile separator ","
set datafile missing "NaN"
set grid ytics mytics lc rgb "#dddddd"
gpu = system("awk -F, 'NR == 2 { print $1 }' " . csv)
last_step = system("awk -F, 'NR > 1 && $4 + 0 > m { m = $4 + 0 } END { print m }' " . csv) + 0
# One group of five words per run, in the CSV's order: run, seed, colour, dash type, line width.
runs = system("awk -F, 'BEGIN { split(\"#1f77b4 #7f7f7f #17becf #2ca02c #9467bd #8c564b\", blue, \" \"); " . \
              "split(\"#d62728 #ff7f0e #e377c2 #bcbd22\", red, \" \") } " . \
              "NR > 1 && !seen[$2 \" \" $3]++ { if ($2 == \"sdpa_flash\") print $2, $3, blue[ns++ % 6 + 1], 1, 1.5; " . \
              "else print $2, $3, red[nf++ % 4 + 1], 2, 2.5 }' " . csv)
n = words(runs) / 5
run(i) = word(runs, 5 * i - 4)
seed(i) = word(runs, 5 * i - 3) + 0
colour(i) = word(runs, 5 * i - 2)
dash(i) = word(runs, 5 * i - 1) + 0
width(i) = word(runs, 5 * i) + 0
label(i) = (run(i) eq "sdpa_flash" ? "SDPA flash backend" : run(i)) . ", seed " . word(runs, 5 * i - 3)
is(name, s) = (strcol(2) eq name && $3 == s) ? $4 : NaN

set multiplot layout 1,3 title sprintf("Copy task (best achievable loss 0), one model trained %d times, %s", n, gpu)
set title "Loss on the copied half (nats, log scale)"
set xlabel "step"
set logscale y
set key top right
plot for [i=1:n] csv using (is(run(i), seed(i))):5 with lines lw width(i) dt dash(i) lc rgb colour(i) title label(i)
set title "The last third, magnified: where the final losses are compared"
set xrange [2 * last_step / 3:last_step]
unset key
plot for [i=1:n] csv using (is(run(i), seed(i))):5 with lines lw width(i) dt dash(i) lc rgb colour(i) notitle
set title "Training throughput (tokens/s, over each logging interval)"
set autoscale x
unset logscale y
set yrange [0:*]
plot for [i=1:n] csv using (is(run(i), seed(i))):6 with lines lw width(i) dt dash(i) lc rgb colour(i) notitle
unset multiplot
