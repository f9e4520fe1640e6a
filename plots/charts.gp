# charts.gp - the course's charts from the tables prepare.awk writes.
# usage: gnuplot -e "dir='DIR'; out='PREFIX'; gpu='NAME'" plots/charts.gp
# Writes PREFIX_progression.png, PREFIX_seqlen.png, PREFIX_speedup.png and PREFIX_backward.png.
set terminal pngcairo size 1400,900 font "Sans,11" noenhanced
set datafile missing "NaN"
set grid ytics mytics lc rgb "#dddddd"
set key outside right top
stages = system("cat " . dir . "/stages.txt")
peers = system("cat " . dir . "/peers.txt 2>/dev/null")
load dir . "/peers.gp"
peer_value(p, d, c) = value(sprintf("%s_D%d_c%d", p, d, c))
peer_colors = "#d62728 #2ca02c #9467bd #8c564b #e377c2"

# 1. Each stage's TFLOP/s at S = 4096, log scale, with the PyTorch backends as dashed lines.
set output out . "_progression.png"
set multiplot layout 1,2 title "Forward TFLOP/s per stage at S = 4096 (B*S = 16384, H*D = 2048), " . gpu
set logscale y
set yrange [0.1:1000]
set ylabel "TFLOP/s (log scale)"
set key inside bottom right
set xtics rotate by -30
set xrange [-0.5:words(stages) - 0.5]
do for [d in "64 128"] {
    set title "D = " . d
    unset arrow
    unset label
    i = 0
    do for [p in peers] {
        i = i + 1
        v = peer_value(p, int(d), 0)
        if (v == v) {
            set arrow from graph 0, first v to graph 1, first v nohead dt 2 lw 1.5 lc rgb word(peer_colors, i)
            set label p . sprintf(" %.0f (non-causal)", v) at graph 0.02, first v * 1.12 tc rgb word(peer_colors, i) font ",9"
        }
    }
    file = dir . "/prog_D" . d . ".dat"
    if (d eq "64") {
        plot file using 1:3:xtic(2) with linespoints lw 2 pt 7 title "non-causal", \
             "" using 1:4 with linespoints lw 2 pt 5 title "causal", \
             "" using 1:5 with linespoints lw 2 pt 9 title "small: B=1 H=8 S=512"
    } else {
        plot file using 1:3:xtic(2) with linespoints lw 2 pt 7 title "non-causal", \
             "" using 1:4 with linespoints lw 2 pt 5 title "causal"
    }
}
unset multiplot
unset arrow
unset label
unset xrange
set xtics norotate
set key outside right top

# 2. TFLOP/s against sequence length, one line per stage; peers dashed.
set output out . "_seqlen.png"
set multiplot layout 2,2 title "Forward TFLOP/s against sequence length (B*S = 16384, H*D = 2048), " . gpu
set logscale x 2
set xlabel "sequence length S"
do for [d in "64 128"] {
    do for [c in "0 1"] {
        set title "D = " . d . (c eq "1" ? ", causal" : ", non-causal")
        plot for [s in stages] dir . "/seq_" . s . "_D" . d . "_c" . c . ".dat" using 1:2 with linespoints lw 2 title s, \
             for [p in peers] dir . "/seq_" . p . "_D" . d . "_c" . c . ".dat" using 1:2 with lines dt 2 lw 2 title p
    }
}
unset multiplot
unset logscale x
unset xlabel

# 3. Speedup over stage 01 at S = 4096.
set output out . "_speedup.png"
set terminal pngcairo size 1000,600 font "Sans,11" noenhanced
set yrange [0.5:*]
set title "Speedup over stage 01 at S = 4096 (B*S = 16384, H*D = 2048), " . gpu
set ylabel "speedup over stage 01 (log scale)"
set style data histogram
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set xtics rotate by -30
plot dir . "/speedup.dat" using 3:xtic(2) title "D=64", "" using 4 title "D=64 causal", \
     "" using 5 title "D=128", "" using 6 title "D=128 causal"

# 4. Backward TFLOP/s against sequence length: the stages with a backward pass (solid) and the
#    PyTorch backends (dashed), FLOPs counted as 2.5x the forward's.
set output out . "_backward.png"
set terminal pngcairo size 1400,900 font "Sans,11" noenhanced
unset logscale
unset style
set style data linespoints
set xtics norotate
set yrange [0:*]
set ylabel "TFLOP/s"
set key outside right top
bwd_stages = system("cat " . dir . "/bwd_stages.txt 2>/dev/null")
bwd_peers = system("cat " . dir . "/bwd_peers.txt 2>/dev/null")
set multiplot layout 2,2 title "Backward TFLOP/s against sequence length (B*S = 16384, H*D = 2048), " . gpu
set logscale x 2
set xlabel "sequence length S"
do for [d in "64 128"] {
    do for [c in "0 1"] {
        set title "D = " . d . (c eq "1" ? ", causal" : ", non-causal")
        plot for [n in bwd_stages] dir . "/bwd_" . n . "_D" . d . "_c" . c . ".dat" using 1:2 with linespoints lw 2 title n, \
             for [p in bwd_peers] dir . "/bwd_" . p . "_D" . d . "_c" . c . ".dat" using 1:2 with lines dt 2 lw 2 title p
    }
}
unset multiplot
