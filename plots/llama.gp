# llama.gp - the chart of python/examples/llama.py's CSV: for each configuration (S, K/V heads),
# the loss per step with SDPA and with flash_stages (left: the two copies of one model, same
# weights and data, so the lines should lie on each other) and the time of each timed step (right).
# usage: gnuplot -e "csv='plots/data/h200_llama.csv'; out='plots/h200_llama.png'" plots/llama.gp
set terminal pngcairo size 1500,600 font "Sans,11" noenhanced
set output out
set datafile separator ","
set datafile missing "NaN"
set grid ytics lc rgb "#dddddd"
gpu = system("awk -F, 'NR == 2 { print $1 }' " . csv)
# One word per configuration, "S:kv_heads", in the CSV's order.
configs = system("awk -F, 'NR > 1 && !seen[$2 \":\" $4]++ { printf \"%s:%s \", $2, $4 }' " . csv)
n = words(configs)
seq(i) = word(system("echo " . word(configs, i) . " | tr ':' ' '"), 1)
kv(i) = word(system("echo " . word(configs, i) . " | tr ':' ' '"), 2)
colour(i) = word("#1f77b4 #d62728 #2ca02c #9467bd #ff7f0e #8c564b", (i - 1) % 6 + 1)
pick(i, impl, column) = (strcol(2) eq seq(i) && strcol(4) eq kv(i) && strcol(8) eq impl) ? column(column) : NaN
heads = system("awk -F, 'NR == 2 { print $3 }' " . csv)
label(i) = sprintf("S=%s, %s K/V heads", seq(i), kv(i))

set multiplot layout 1,2 title sprintf("A %s-head Llama (D = 128) trained in bf16, SDPA (solid) and flash_stages (dashed), %s", heads, gpu)
set title "Loss per step"
set xlabel "step"
set ylabel "loss (nats)"
set key top right
plot for [i=1:n] csv using 10:(pick(i, "sdpa", 11)) with lines lw 2 lc rgb colour(i) title label(i), \
     for [i=1:n] csv using 10:(pick(i, "flash_stages", 11)) with lines lw 2 dt 2 lc rgb colour(i) notitle
set title "Time per timed step (ms): forward, backward and AdamW"
set key bottom right
set ylabel "ms"
set yrange [0:*]
plot for [i=1:n] csv using 10:(pick(i, "sdpa", 12)) with linespoints pt 7 ps 0.5 lw 1.5 lc rgb colour(i) title label(i), \
     for [i=1:n] csv using 10:(pick(i, "flash_stages", 12)) with linespoints pt 6 ps 0.5 lw 1.5 dt 2 lc rgb colour(i) notitle
unset multiplot
