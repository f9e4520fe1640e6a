# prepare.awk - split one benchmark CSV into the small tables plots/charts.gp draws.
# usage: awk -v dir=DIR -f prepare.awk plots/data/<gpu>.csv
# Writes, for the forward rows:
#   DIR/stages.txt, peers.txt     stage names in course order (rows named NN_...), the peers (the rest)
#   DIR/seq_<name>_D<d>_c<c>.dat  "S TFLOP/s" on the sweep (B*S = 16384, H*D = 2048)
#   DIR/prog_D<d>.dat             "index label TFLOP/s(non-causal) TFLOP/s(causal) TFLOP/s(small)" at S = 4096
#   DIR/speedup.dat               "index label" then speedup over stage 01 for D64, D64c, D128, D128c
#   DIR/peers.gp                  gnuplot variables: peer TFLOP/s at S = 4096 per D and causal
# and, for the backward rows:
#   DIR/bwd_stages.txt, bwd_peers.txt  the stages with a backward pass, the peers
#   DIR/bwd_<name>_D<d>_c<c>.dat  "S TFLOP/s" on the sweep
BEGIN { FS = ","; }
NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
$col["direction"] == "bwd" && $col["batch"] * $col["seq"] == 16384 && $col["heads"] * $col["dim"] == 2048 {
    name = $col["stage"]
    if (!(name in bseen)) { bseen[name] = 1; if (name !~ /^[0-9][0-9]_/) bpeers[++nbp] = name; else bstages[++nbs] = name }
    print $col["seq"] + 0, $col["tflops"] + 0 >> (dir "/bwd_" name "_D" ($col["dim"] + 0) "_c" ($col["causal"] + 0) ".dat")
}
$col["direction"] == "fwd" {
    name = $col["stage"]; S = $col["seq"] + 0; D = $col["dim"] + 0; c = $col["causal"] + 0
    B = $col["batch"] + 0; H = $col["heads"] + 0; tf = $col["tflops"] + 0
    if (!(name in seen)) { seen[name] = 1; if (name !~ /^[0-9][0-9]_/) peers[++np] = name; else stages[++ns] = name }
    if (B * S == 16384 && H * D == 2048) {
        file = dir "/seq_" name "_D" D "_c" c ".dat"
        print S, tf >> file
        if (S == 4096) at4096[name, D, c] = tf
    } else if (B == 1 && H == 8 && S == 512 && D == 64 && c == 0) {
        small[name] = tf
    }
}
function val(x) { return x == "" ? "NaN" : x }
END {
    for (i = 1; i <= ns; i++) print stages[i] > (dir "/stages.txt")
    for (i = 1; i <= nbs; i++) print bstages[i] > (dir "/bwd_stages.txt")
    for (i = 1; i <= nbp; i++) print bpeers[i] > (dir "/bwd_peers.txt")
    for (i = 1; i <= np; i++) print peers[i] > (dir "/peers.txt")
    for (d = 64; d <= 128; d += 64) {
        file = dir "/prog_D" d ".dat"
        for (i = 1; i <= ns; i++) {
            n = stages[i]
            print i - 1, n, val(at4096[n, d, 0]), val(at4096[n, d, 1]), (d == 64 ? val(small[n]) : "NaN") > file
        }
    }
    base = stages[1]
    for (i = 1; i <= ns; i++) {
        n = stages[i]; line = (i - 1) " " n
        for (d = 64; d <= 128; d += 64)
            for (c = 0; c <= 1; c++) {
                b = at4096[base, d, c]; x = at4096[n, d, c]
                line = line " " ((b != "" && x != "") ? x / b : "NaN")
            }
        print line > (dir "/speedup.dat")
    }
    for (i = 1; i <= np; i++)
        for (d = 64; d <= 128; d += 64)
            for (c = 0; c <= 1; c++)
                printf "%s_D%d_c%d = %s\n", peers[i], d, c, val(at4096[peers[i], d, c]) > (dir "/peers.gp")
}
