# roofline.awk - where each stage's forward pass sits against the GPU's measured ceilings, at
# S = 4096, B = 4, H*D = 2048, non-causal, D = 64 and 128.
# usage: awk -F, -v profiles=plots/data/<gpu>_profiles.csv -v ceilings=plots/data/<gpu>_ceilings.csv \
#            -f plots/roofline.awk plots/data/<gpu>.csv
# Prints one line per stage and D: "stage D intensity tflops ceiling percent bound", where
#   intensity  FLOPs (4 B H S^2 D) per byte of DRAM traffic, the bytes ncu counted over the
#              forward's kernels (plots/profiles.sh);
#   tflops     the benchmark's median (the same CSV row the course table shows);
#   ceiling    min(peak of the units the stage computes S = QK^T on, intensity x copy bandwidth):
#              FP32 CUDA cores for stages 01-04, tensor cores from stage 05 on;
#   bound      what sets the ceiling: "bandwidth", "fp32_cores" or "tensor_cores".
# Stages without a profile or ceilings print nothing.
BEGIN {
    while ((getline line < ceilings) > 0) {
        split(line, f, ",")
        if (f[2] == "copy_bandwidth") bandwidth = f[3]            # GB/s
        if (f[2] == "fp16_tensor_core_matmul") peak["tc"] = f[3]  # TFLOP/s
        if (f[2] == "fp32_simt_matmul") peak["simt"] = f[3]
    }
    # gpu,build,kernel,dim,metric,value,unit,commit: DRAM bytes of the forward's kernels.
    while ((getline line < profiles) > 0) {
        split(line, f, ",")
        if ((f[5] == "dram__bytes_read.sum" || f[5] == "dram__bytes_write.sum") && f[3] !~ /^backward/)
            bytes[f[2], f[4]] += f[6]
    }
}
NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
$col["direction"] == "fwd" && $col["batch"] == 4 && $col["seq"] == 4096 && $col["causal"] == 0 &&
$col["heads"] * $col["dim"] == 2048 && $col["stage"] ~ /^[0-9][0-9]_/ {
    stage = $col["stage"]; D = $col["dim"]
    if (!((stage, D) in bytes) || bandwidth == "" || bytes[stage, D] <= 0) next
    flops = 4 * $col["batch"] * $col["heads"] * $col["seq"] * $col["seq"] * D
    intensity = flops / bytes[stage, D]
    unit = substr(stage, 1, 2) + 0 <= 4 ? "simt" : "tc"
    ceiling = intensity * bandwidth / 1000; bound = "bandwidth"
    if (peak[unit] != "" && peak[unit] < ceiling) { ceiling = peak[unit]; bound = unit == "tc" ? "tensor_cores" : "fp32_cores" }
    printf "%s %d %.1f %.3f %.1f %.1f %s\n", stage, D, intensity, $col["tflops"], ceiling, 100 * $col["tflops"] / ceiling, bound
}
