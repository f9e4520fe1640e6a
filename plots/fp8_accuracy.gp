# fp8_accuracy.gp - the chart of stage 11's accuracy experiment (plots/fp8_accuracy.py): the RMSE
# of O against float64 per method, on N(0,1) inputs and on inputs with 0.1% outliers, log scale.
# usage: gnuplot -e "data='points.txt'; out='plots/h200_fp8_accuracy.png'; gpu='NVIDIA H200'" plots/fp8_accuracy.gp
# (points: python3 plots/tables.py --fp8-accuracy CSV, one line per method: "label" normal outliers)
set terminal pngcairo size 1400,560 font "Sans,11" noenhanced
set output out
set title sprintf("RMSE of O against float64, B = 4, H = 8, S = 1024, D = 128 (%s)", gpu)
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set boxwidth 0.9
set logscale y
set format y "%.0e"
set yrange [1e-5:0.1]
set ylabel "RMSE (log scale)"
set grid ytics lc rgb "#dddddd"
set key top left
set xtics scale 0 font ",10"
set xrange [-0.6:3.6]
plot data using 2:xtic(1) title "inputs N(0,1)" lc rgb "#1f77b4", \
     '' using 3 title "N(0,1) + N(0,100) Bernoulli(0.001): 0.1% outliers" lc rgb "#d62728"
