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
# The same GPU's other CSVs: ablation builds, Nsight Compute metrics, ceilings.
ablations_csv=${csv%.csv}_ablations.csv
profiles_csv=${csv%.csv}_profiles.csv
ceilings_csv=${csv%.csv}_ceilings.csv
slug=$(basename "${csv%.csv}")  # the GPU's name in file names: h100

# The course table: each stage and peer at S = 4096 on the sweep, plus the small shape.
course_table() {
    [ -f "$csv" ] || { echo "_No H100 measurements committed yet (plots/data/h100.csv)._"; return; }
    local percents=""
    if [ -f "$profiles_csv" ] && [ -f "$ceilings_csv" ]; then
        percents=$(awk -F, -v profiles="$profiles_csv" -v ceilings="$ceilings_csv" -f plots/roofline.awk "$csv" |
            awk '{ print $1, $2, $6 }')
    fi
    awk -F, -v percents="$percents" '
    BEGIN { m = split(percents, lines, "\n"); for (i = 1; i <= m; i++) { split(lines[i], f, " "); pc[f[1], f[2]] = f[3] } }
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
        if (m > 0) {
            print "| stage | D=64 | D=64 causal | D=128 | D=128 causal | B=1 H=8 S=512 D=64 (us) | % of measured ceiling, D=64 / D=128 |"
            print "|---|---:|---:|---:|---:|---:|---:|"
        } else {
            print "| stage | D=64 | D=64 causal | D=128 | D=128 causal | B=1 H=8 S=512 D=64 (us) |"
            print "|---|---:|---:|---:|---:|---:|"
        }
        for (i = 1; i <= k; i++) { n = order[i]
            line = sprintf("| %s | %s | %s | %s | %s | %s |", n, v(tf[n,64,0]), v(tf[n,64,1]), v(tf[n,128,0]), v(tf[n,128,1]), v(small[n]))
            if (m > 0) line = line sprintf(" %s |", (n, 64) in pc ? pc[n, 64] " / " pc[n, 128] : "-")
            print line }
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

# A stage's TFLOP/s over a peer's, shape by shape, at S = 2048 ... 16384 (forward): the stage's
# target against the flash backend; the lowest ratio in bold.
ratio_table() {  # ratio_table STAGE PEER [fwd|bwd] [FIRST_S]
    local stage=$1 peer=$2 direction=${3:-fwd} first=${4:-2048}
    [ -f "$csv" ] || { echo "_No H100 measurements committed yet ($csv)._"; return 0; }
    awk -F, -v stage="$stage" -v peer="$peer" -v direction="$direction" -v first="$first" '
    NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
    $col["direction"] == direction && $col["batch"] * $col["seq"] == 16384 && $col["heads"] * $col["dim"] == 2048 && $col["seq"] >= first + 0 {
        tf[$col["stage"], $col["seq"], $col["dim"], $col["causal"]] = $col["tflops"]
    }
    END {
        low = 1e9
        for (D = 64; D <= 128; D += 64) for (c = 0; c <= 1; c++) for (S = first; S <= 16384; S *= 2)
            if ((stage, S, D, c) in tf && (peer, S, D, c) in tf) {
                r[S, D, c] = tf[stage, S, D, c] / tf[peer, S, D, c]
                if (r[S, D, c] < low) { low = r[S, D, c]; at = S SUBSEP D SUBSEP c }
            }
        print "Ratios " stage " / " peer ", " (direction == "fwd" ? "forward" : "backward") ", from the same run (`" FILENAME "`); the lowest in bold:"
        print ""
        header = "| " stage " / " peer
        for (S = first; S <= 16384; S *= 2) header = header (S == first ? " | S = " : " | ") S
        print header " |"
        rule = "|---"; for (S = first; S <= 16384; S *= 2) rule = rule "|---:"
        print rule "|"
        for (c = 0; c <= 1; c++) for (D = 64; D <= 128; D += 64) {
            line = "| D = " D (c ? " causal" : "")
            for (S = first; S <= 16384; S *= 2) {
                if (!((S, D, c) in r)) { line = line " | -"; continue }
                x = sprintf("%.3f", r[S, D, c])
                line = line " | " ((S SUBSEP D SUBSEP c) == at ? "**" x "**" : x)
            }
            print line " |"
        }
    }' "$csv"
}

# A stage's ablation builds (stages/<stage>/ablations.txt, timed by plots/ablations.sh): TFLOP/s
# at S = 4096 (and any other sequence length the file names in "# sequence lengths: ...") of the
# stage as built and of each build with one idea switched off, from one run, with the ratio to the
# stage as built; the previous stage's as-built row for reference, and a PyTorch backend from the
# sweep of the same GPU's CSV where the file names one in "# compare with: ...".
ablation_table() {
    local stage=$1 list=stages/$1/ablations.txt file=${ablations_csv}
    [ -f "$list" ] || return 0
    [ -f "$file" ] || { echo "_No ablation measurements committed yet ($file)._"; return 0; }
    local previous
    previous=$(basename "$(ls -d stages/"$(printf '%02d' $((10#${stage:0:2} - 1)))"_* 2>/dev/null | head -n 1)" 2>/dev/null || true)
    awk -F, -v stage="$stage" -v list="$list" -v previous="$previous" -v sweep="$csv" '
    BEGIN {
        while ((getline line < list) > 0) {
            if (line ~ /^# sequence lengths:/) { sub(/^# sequence lengths: */, "", line); n_seq = split(line, seqs, " ") }
            if (line ~ /^# compare with:/) { sub(/^# compare with: */, "", line); peer = line }
            if (line ~ /^#/ || line ~ /^[ \t]*$/) continue
            split(line, f, "|")
            for (i = 1; i <= 4; i++) gsub(/^[ \t]+|[ \t]+$/, "", f[i])
            names[++n] = f[1]; passes[f[1]] = f[2]; what[f[1]] = f[4]
            if (f[2] ~ /bwd/) has_bwd = 1
        }
        if (n_seq == 0) { n_seq = 1; seqs[1] = 4096 }
        # The peer from the sweep, at the sweep shape of each sequence length (B * S = 16384).
        if (peer != "") {
            FS = ","
            while ((getline line < sweep) > 0) {
                m = split(line, v, ",")
                if (v[1] == "gpu") { for (i = 1; i <= m; i++) scol[v[i]] = i; continue }
                if (v[scol["stage"]] == peer && v[scol["batch"]] * v[scol["seq"]] == 16384)
                    tf[peer, v[scol["seq"]], v[scol["direction"]], v[scol["dim"]], v[scol["causal"]]] = v[scol["tflops"]]
            }
        }
    }
    NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
    {
        tf[$col["stage"], $col["seq"], $col["direction"], $col["dim"], $col["causal"]] = $col["tflops"]
        gpu = $col["gpu"]; commit[$col["commit"]] = 1
    }
    function cell(build, seq, pass, d, c,    x, b) {
        if (!((build, seq, pass, d, c) in tf)) return "-"
        x = tf[build, seq, pass, d, c]
        if (build == stage || !((stage, seq, pass, d, c) in tf)) return sprintf("%.1f", x)
        b = tf[stage, seq, pass, d, c]
        return sprintf("%.1f (%.2fx)", x, x / b)
    }
    function row(build, seq, label, pass, change) {
        printf "| %s | %s | %s | %s | %s | %s | %s |\n", label, pass, change, cell(build, seq, pass, 64, 0),
            cell(build, seq, pass, 64, 1), cell(build, seq, pass, 128, 0), cell(build, seq, pass, 128, 1)
    }
    END {
        cs = ""; for (x in commit) cs = cs (cs == "" ? "" : ", ") x
        for (k = 1; k <= n_seq; k++) {
            seq = seqs[k]
            if (k > 1) print ""
            print "TFLOP/s at S = " seq " (B = " 16384 / seq ", H*D = 2048) on the " gpu ", one run of `plots/ablations.sh` (commit " cs "), from `" FILENAME "`; in brackets the ratio to the stage as built" (peer != "" ? " (for " peer ", from the sweep of the same run in `" sweep "`)" : "") ":"
            print ""
            print "| build | pass | what the build changes | D=64 | D=64 causal | D=128 | D=128 causal |"
            print "|---|---|---|---:|---:|---:|---:|"
            row(stage, seq, stage " as built", "fwd", "")
            if (has_bwd) row(stage, seq, stage " as built", "bwd", "")
            for (i = 1; i <= n; i++) {
                split(passes[names[i]], p, " ")
                for (j = 1; j in p; j++) row(stage "." names[i], seq, "`." names[i] "`", p[j], what[names[i]])
            }
            if (previous != "" && (previous, seq, "fwd", 64, 0) in tf) row(previous, seq, previous " as built (previous stage)", "fwd", "")
            if (peer != "") {
                row(peer, seq, peer " (PyTorch)", "fwd", "")
                if (has_bwd) row(peer, seq, peer " (PyTorch)", "bwd", "")
            }
        }
    }' "$file"
}

# The metrics the lessons quote from Nsight Compute (plots/profiles.sh), one column per profiled
# build, kernel and D of a stage; a row per metric.
profile_table() {
    local stage=$1 file=${profiles_csv}
    [ -f "$file" ] || { echo "_No profile committed yet ($file)._"; return 0; }
    awk -F, -v stage="$stage" -v profiles="$file" -v slug="$slug" '
    NR == 1 { next }
    $2 == stage || index($2, stage ".") == 1 {
        key = $2 SUBSEP $3 SUBSEP $4
        if (!(key in seen)) { seen[key] = 1; keys[++n] = key }
        v[key, $5] = $6; unit[key, $5] = $7; gpu = $1; commit[$8] = 1
        if ($5 ~ /^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$/) {
            reason = $5; sub(/^smsp__average_warps_issue_stalled_/, "", reason); sub(/_per_issue_active\.ratio$/, "", reason)
            if (reason != "selected") stall[key, reason] = $6 + 0
        }
    }
    function has(k, m) { return (k, m) in v }
    function ms(k,    x) { x = v[k, "gpu__time_duration.sum"]; u = unit[k, "gpu__time_duration.sum"]
        return sprintf("%.2f", u == "msecond" ? x : u == "usecond" ? x / 1e3 : x / 1e6) }
    function pct(k, m) { return has(k, m) ? sprintf("%.1f", v[k, m]) : "-" }
    function num(k, m, scale, fmt) { return has(k, m) ? sprintf(fmt, v[k, m] / scale) : "-" }
    function top(k, rank,    r, best, bestv, i, used) {
        for (i = 1; i <= rank; i++) {
            best = ""; bestv = -1
            for (r in reasons) if (!(r in used) && (k, r) in stall && stall[k, r] > bestv) { best = r; bestv = stall[k, r] }
            used[best] = 1
        }
        return best == "" ? "-" : sprintf("%s %.2f", best, bestv)
    }
    END {
        if (n == 0) { print "_No profile of " stage " in the committed CSV._"; exit }
        for (x in stall) { split(x, p, SUBSEP); reasons[p[4]] = 1 }
        cs = ""; for (x in commit) cs = cs (cs == "" ? "" : ", ") x
        print "Nsight Compute on the " gpu " (`plots/profiles.sh`, commit " cs "), S = 4096, B = 4, H*D = 2048, non-causal; every kernel of one run. Full pages in `docs/profiles/" stage "_" slug "_ncu.txt`, metrics in `" profiles "`:"
        print ""
        line = "| metric"; rule = "|---"
        for (i = 1; i <= n; i++) { split(keys[i], p, SUBSEP)
            label = p[1] == stage ? "" : "`" substr(p[1], length(stage) + 1) "` "
            line = line " | " label "`" p[2] "` D=" p[3]; rule = rule "|---:" }
        print line " |"; print rule "|"
        row("duration under ncu (ms)", "time")
        row("compute (SM) throughput, % of peak", "sm__throughput.avg.pct_of_peak_sustained_elapsed")
        row("memory throughput, % of peak", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed")
        row("DRAM throughput, % of peak", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed")
        row("DRAM traffic (GB)", "dram")
        row("registers per thread", "launch__registers_per_thread")
        row("blocks per SM the registers allow", "launch__occupancy_limit_registers")
        row("blocks per SM the shared memory allows", "launch__occupancy_limit_shared_mem")
        row("theoretical occupancy, %", "sm__maximum_warps_per_active_cycle_pct")
        row("achieved occupancy, %", "sm__warps_active.avg.pct_of_peak_sustained_active")
        row("issue slots busy, %", "smsp__issue_active.avg.pct_of_peak_sustained_active")
        row("FMA pipe active, %", "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active")
        row("tensor (mma.sync) pipe active, %", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")
        row("shared-load wavefronts (M)", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum")
        row("shared-load bank conflicts (M)", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum")
        row("top stall, cycles per issued instruction", "stall1")
        row("second stall", "stall2")
    }
    function row(label, what,    i, k, line, x) {
        line = "| " label
        for (i = 1; i <= n; i++) { k = keys[i]
            if (what == "time") x = has(k, "gpu__time_duration.sum") ? ms(k) : "-"
            else if (what == "dram") x = has(k, "dram__bytes_read.sum") ? sprintf("%.2f", (v[k, "dram__bytes_read.sum"] + v[k, "dram__bytes_write.sum"]) / 1e9) : "-"
            else if (what == "stall1") x = top(k, 1)
            else if (what == "stall2") x = top(k, 2)
            else if (what ~ /sum$/) x = num(k, what, 1e6, "%.1f")
            else if (what ~ /^launch__/) x = num(k, what, 1, "%d")
            else x = pct(k, what)
            line = line " | " x }
        print line " |"
    }' "$file"
}

# A stage's kernels beside a PyTorch peer's, from the same Nsight Compute run (plots/profiles.sh,
# sdpa_<backend> rows): one column per BUILD:KERNEL and D, KERNEL matched as a part of the name.
peer_profile_table() {  # peer_profile_table BUILD:KERNEL...
    [ -f "$profiles_csv" ] || { echo "_No profile committed yet ($profiles_csv)._"; return 0; }
    awk -F, -v specs="$*" -v profiles="$profiles_csv" '
    BEGIN { n = split(specs, spec, " ") }
    NR == 1 { next }
    { for (i = 1; i <= n; i++) { split(spec[i], p, ":")
          if ($2 == p[1] && index($3, p[2]) > 0) { v[i, $4, $5] = $6; name[i] = $3; d[$4] = 1; gpu = $1; commit[$2 " at " $8] = 1 } } }
    function val(i, D, m, scale, fmt) { return (i, D, m) in v ? sprintf(fmt, v[i, D, m] / scale) : "-" }
    function row(label, m, scale, fmt,    line, D, i) {
        line = "| " label
        for (D = 64; D <= 128; D += 64) for (i = 1; i <= n; i++) line = line " | " val(i, D, m, scale, fmt)
        print line " |"
    }
    END {
        if (!(64 in d) || !(128 in d)) { print "_No profile of " specs " in the committed CSV._"; exit }
        cs = ""; for (x in commit) cs = cs (cs == "" ? "" : ", ") x
        print "Nsight Compute on the " gpu " (`plots/profiles.sh`; " cs "), S = 4096, B = 4, H*D = 2048, non-causal, one run of each program; metrics in `" profiles "`:"
        print ""
        line = "| metric"; rule = "|---"
        for (D = 64; D <= 128; D += 64) for (i = 1; i <= n; i++) { split(spec[i], p, ":")
            label = name[i]; sub(/^.*::/, "", label)
            if (length(label) > 40) label = p[2] "…"
            line = line " | " p[1] " `" label "` D=" D; rule = rule "|---:" }
        print line " |"; print rule "|"
        row("duration under ncu (ms)", "gpu__time_duration.sum", 1e6, "%.2f")
        row("grid (blocks)", "launch__grid_size", 1, "%d")
        row("threads per block", "launch__block_size", 1, "%d")
        row("shared memory per block (bytes)", "launch__shared_mem_per_block_dynamic", 1, "%d")
        row("registers per thread", "launch__registers_per_thread", 1, "%d")
        row("shared-load wavefronts (M)", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum", 1e6, "%.1f")
        row("shared-store wavefronts (M)", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum", 1e6, "%.1f")
        row("L1 (shared memory) throughput, % of peak", "l1tex__throughput.avg.pct_of_peak_sustained_active", 1, "%.1f")
        row("tensor pipe active, %", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", 1, "%.1f")
        row("issue slots busy, %", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1, "%.1f")
    }' "$profiles_csv"
}

# Stage 04's experiment: stage 03, stage 03 with stage 04's shared memory per block (unused), and
# stage 04; speed from the ablation run, resources and occupancy from the profile.
occupancy_table() {
    [ -f "$ablations_csv" ] && [ -f "$profiles_csv" ] || { echo "_Not measured yet ($ablations_csv, $profiles_csv)._"; return 0; }
    awk -F, -v profiles="$profiles_csv" '
    BEGIN {
        while ((getline line < profiles) > 0) { split(line, f, ","); m[f[2], f[4], f[5]] = f[6]; gpu = f[1] }
        builds[1] = "03_online_softmax"; builds[2] = "03_online_softmax.smem_of_04"; builds[3] = "04_smem_state"
    }
    NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
    $col["direction"] == "fwd" && $col["causal"] == 0 { tf[$col["stage"], $col["dim"]] = $col["tflops"]; commit = $col["commit"] }
    function get(b, d, k) { return (b, d, k) in m ? m[b, d, k] : "-" }
    END {
        print "On the " gpu ": TFLOP/s at S = 4096, non-causal (`" FILENAME "`, commit " commit "); resources and occupancy from Nsight Compute (`" profiles "`):"
        print ""
        print "| build | D | TFLOP/s | shared memory per block (bytes) | registers per thread | blocks per SM: registers / shared memory | theoretical occupancy % | achieved occupancy % |"
        print "|---|---:|---:|---:|---:|---|---:|---:|"
        for (d = 64; d <= 128; d += 64) for (i = 1; i <= 3; i++) { b = builds[i]
            printf "| %s | %d | %s | %s | %s | %s / %s | %s | %s |\n", b, d, (b, d) in tf ? sprintf("%.2f", tf[b, d]) : "-",
                get(b, d, "launch__shared_mem_per_block_dynamic"), get(b, d, "launch__registers_per_thread"),
                get(b, d, "launch__occupancy_limit_registers"), get(b, d, "launch__occupancy_limit_shared_mem"),
                get(b, d, "sm__maximum_warps_per_active_cycle_pct"), (b, d, "sm__warps_active.avg.pct_of_peak_sustained_active") in m ? sprintf("%.1f", m[b, d, "sm__warps_active.avg.pct_of_peak_sustained_active"]) : "-" }
    }' "$ablations_csv"
}

# Where each stage sits against the measured ceilings (plots/roofline.awk), beside the roofline chart.
roofline_table() {
    [ -f "$profiles_csv" ] && [ -f "$ceilings_csv" ] || { echo "_Not measured yet ($profiles_csv, $ceilings_csv)._"; return 0; }
    echo "Forward at S = 4096, B = 4, H*D = 2048, non-causal. Intensity: FLOPs per byte of DRAM traffic that"
    echo "Nsight Compute counted (\`$profiles_csv\`); TFLOP/s from \`$csv\`; ceiling: the lower of the peak of"
    echo "the units that compute QKᵀ (FP32 CUDA cores for 01–04, tensor cores from 05) and intensity × copy"
    echo "bandwidth (\`$ceilings_csv\`):"
    echo
    echo "| stage | D | FLOP per DRAM byte | TFLOP/s | ceiling (TFLOP/s) | % of ceiling |"
    echo "|---|---:|---:|---:|---:|---:|"
    awk -F, -v profiles="$profiles_csv" -v ceilings="$ceilings_csv" -f plots/roofline.awk "$csv" |
        awk '{ bound = $7; gsub(/_/, " ", bound); sub(/^fp32/, "FP32", bound)
               printf "| %s | %s | %s | %.1f | %s (%s) | %s |\n", $1, $2, $3, $4, $5, bound, $6 }'
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

# The training runs of python/examples/train.py (plots/data/h100_training.csv): per run, the loss at
# the last logged step, the mean of the last ten logged losses, the first logged step below 0.01
# nats and the median of the logged throughputs. Then the verdict the example exists for: whether
# each flash_stages run's final loss and last-ten mean lie within the min..max of the SDPA runs
# (seeds apart, the noise), compared at the 5 decimals shown; and flash_stages' throughput over
# the SDPA runs'.
training_table() {
    local file=plots/data/h100_training.csv
    [ -f "$file" ] || { echo "_No training run committed yet ($file)._"; return; }
    awk -F, '
    NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
    {
        r = $col["run"] " seed " $col["seed"]; gpu = $col["gpu"]
        if (!(r in seen)) {
            seen[r] = 1; order[++k] = r; kernel[r] = $col["run"]
            if (kernel[r] == "sdpa_flash") sdpa_seeds = sdpa_seeds (sdpa_seeds == "" ? "" : ", ") $col["seed"]
            else { ours = kernel[r]; our_seeds = our_seeds (our_seeds == "" ? "" : ", ") $col["seed"] }
        }
        n[r]++; loss[r, n[r]] = $col["loss"]; last_step[r] = $col["step"]
        if (!(r in floor_step) && $col["loss"] + 0 < 0.01) floor_step[r] = $col["step"]
        if ($col["tokens_per_s"] != "") rate[r, ++m[r]] = $col["tokens_per_s"] + 0
    }
    function median(r,    i, j, t, a) {
        for (i = 1; i <= m[r]; i++) a[i] = rate[r, i]
        for (i = 2; i <= m[r]; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
        return m[r] % 2 ? a[(m[r] + 1) / 2] : (a[m[r] / 2] + a[m[r] / 2 + 1]) / 2
    }
    function shown(x) { return sprintf("%.5f", x) }  # as the table prints it, and compared so
    function runs(count, seeds) { return count " run" (count == 1 ? "" : "s") " (seed" (count == 1 ? " " : "s ") seeds ")" }
    # e.g. "0.00016, below the range of the SDPA runs (0.00019..0.00020)", or "..., within the range ..."
    function verdict(x, lo, hi) {
        return shown(x) ", " (x + 0 < lo + 0 ? "outside (below)" : x + 0 > hi + 0 ? "outside (above)" : "within") \
            " the range of the SDPA runs, " lo ".." hi
    }
    END {
        for (i = 1; i <= k; i++) { r = order[i]; s = 0
            for (j = n[r] - 9; j <= n[r]; j++) s += loss[r, j]
            last[r] = shown(loss[r, n[r]]); mean[r] = shown(s / 10); med[r] = median(r)
            if (kernel[r] == "sdpa_flash") n_sdpa++; else n_ours++
        }
        line = "One invocation of `python/examples/train.py` on the " gpu ", from `" FILENAME "`:"
        if (n_sdpa) line = line " SDPA flash, " runs(n_sdpa, sdpa_seeds)
        if (n_ours) line = line (n_sdpa ? ", and " : " ") ours ", " runs(n_ours, our_seeds)
        print line "; runs of one seed start from the same weights and see the same data:"
        print ""
        print "| run | loss at the last step | mean of the last 10 logged losses | first logged step below 0.01 | median tokens/s |"
        print "|---|---:|---:|---:|---:|"
        for (i = 1; i <= k; i++) { r = order[i]
            printf "| %s | %s (step %d) | %s | %s | %.0f |\n", r, last[r], last_step[r], mean[r],
                   (r in floor_step) ? floor_step[r] : "-", med[r] }
        if (!n_sdpa || !n_ours) exit
        first = 1
        for (i = 1; i <= k; i++) { r = order[i]
            if (kernel[r] != "sdpa_flash") continue
            if (first || last[r] + 0 < last_lo + 0) last_lo = last[r]
            if (first || last[r] + 0 > last_hi + 0) last_hi = last[r]
            if (first || mean[r] + 0 < mean_lo + 0) mean_lo = mean[r]
            if (first || mean[r] + 0 > mean_hi + 0) mean_hi = mean[r]
            first = 0
        }
        print ""
        for (i = 1; i <= k; i++) { r = order[i]
            if (kernel[r] == "sdpa_flash") continue
            lo = hi = ""
            for (j = 1; j <= k; j++) if (kernel[order[j]] == "sdpa_flash") {
                ratio = med[r] / med[order[j]]
                if (lo == "" || ratio < lo) lo = ratio
                if (hi == "" || ratio > hi) hi = ratio
            }
            printf "- %s: loss at the last step %s; mean of the last 10 logged losses %s. Throughput %s over SDPA flash.\n",
                   r, verdict(last[r], last_lo, last_hi), verdict(mean[r], mean_lo, mean_hi),
                   lo == hi ? sprintf("%.3fx", lo) : sprintf("%.3fx..%.3fx", lo, hi)
        }
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
    if [ -f "$profiles_csv" ] && [ -f "$ceilings_csv" ]; then
        echo
        roofline_table
    fi
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
        if [ -f "stages/$stage/ablations.txt" ] && [ -f "$ablations_csv" ]; then
            echo
            ablation_table "$stage"
        fi
        if [ -f "$profiles_csv" ]; then
            echo
            profile_table "$stage"
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
occupancy_table | process stages/04_smem_state/README.md 04_smem_state:occupancy
ratio_table 07_swizzle_cp_async sdpa_flash | process stages/07_swizzle_cp_async/README.md 07_swizzle_cp_async:vs_flash
ratio_table 09_tma_wgmma sdpa_cudnn fwd 1024 | process stages/09_tma_wgmma/README.md 09_tma_wgmma:vs_cudnn
ratio_table 09_tma_wgmma sdpa_cudnn bwd 2048 | process stages/09_tma_wgmma/README.md 09_tma_wgmma:bwd_vs_cudnn
peer_profile_table 08_warp_specialized:backward_dk_dv sdpa_flash:flash_bwd_dq_dk_dv |
    process stages/08_warp_specialized/README.md 08_warp_specialized:vs_flash_profile
peer_profile_table 09_tma_wgmma:backward_dk_dv 09_tma_wgmma.deterministic_dq:backward_dk_dv \
    09_tma_wgmma.deterministic_dq:backward_dq sdpa_cudnn:flash_bprop |
    process stages/09_tma_wgmma/README.md 09_tma_wgmma:vs_cudnn_profile
roofline_table | process README.md roofline
training_table | process README.md training
training_table | process python/README.md training
for lesson in stages/*/README.md; do
    stage=$(basename "$(dirname "$lesson")")
    stage_table "$stage" fwd | process "$lesson" "$stage"
    stage_table "$stage" bwd | process "$lesson" "$stage:bwd"
    ablation_table "$stage" | process "$lesson" "$stage:ablations"
    profile_table "$stage" | process "$lesson" "$stage:profile"
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
