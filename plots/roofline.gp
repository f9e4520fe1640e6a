# roofline.gp - every stage's forward pass against the GPU's measured ceilings (a roofline).
# usage: gnuplot -e "data='FILE'; out='PNG'; gpu='NAME'; bandwidth=GBS; tc=TFLOPS; simt=TFLOPS" plots/roofline.gp
# FILE holds the lines of plots/tables.py --roofline: stage D intensity tflops ceiling percent bound.
set terminal pngcairo size 1200,800 font "Sans,11" noenhanced
set output out
set title "Forward pass at S = 4096 (B = 4, H*D = 2048, non-causal) against the measured ceilings, " . gpu
set logscale xy
set xlabel "arithmetic intensity: FLOPs per byte of DRAM traffic (Nsight Compute)"
set ylabel "TFLOP/s (benchmark median)"
set xrange [1:10000]
set yrange [0.1:2000]
set grid xtics ytics mxtics mytics lc rgb "#e5e5e5"
set key inside bottom right
set samples 2000
memory(x) = x * bandwidth / 1000
roof(x, peak) = memory(x) < peak ? memory(x) : peak
set label sprintf("tensor cores, fp16 (measured): %.0f TFLOP/s", tc) at 1.3, tc * 1.25 tc rgb "#1f77b4"
set label sprintf("FP32 CUDA cores (measured): %.1f TFLOP/s", simt) at 1.3, simt * 1.25 tc rgb "#ff7f0e"
set label sprintf("copy bandwidth %.0f GB/s", bandwidth) at 1.3, memory(1.3) * 1.6 rotate by 28 tc rgb "#555555"
plot roof(x, tc) with lines lw 2 lc rgb "#1f77b4" title "tensor-core roof", \
     roof(x, simt) with lines lw 2 dt 2 lc rgb "#ff7f0e" title "FP32-core roof", \
     data using ($2 == 64 ? $3 : 1/0):4 with points pt 7 ps 1.6 lc rgb "#2ca02c" title "D = 64", \
     data using ($2 == 128 ? $3 : 1/0):4 with points pt 5 ps 1.6 lc rgb "#d62728" title "D = 128", \
     data using ($2 == 64 ? $3 : 1/0):4:(substr(strcol(1), 1, 2)) with labels offset char 1.4, char 0 font ",10" notitle, \
     data using ($2 == 128 ? $3 : 1/0):4:(substr(strcol(1), 1, 2)) with labels offset char -1.4, char 0 font ",10" notitle
