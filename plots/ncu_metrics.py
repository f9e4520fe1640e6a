#!/usr/bin/env python3
"""ncu_metrics.py RAW.csv --gpu NAME --build PROGRAM --dim D --commit C

Reads the raw page of one Nsight Compute report (`ncu --import R --page raw --csv --print-units
base`) and prints the metrics the lessons and the roofline use, one CSV row per kernel and metric:
gpu,build,kernel,dim,metric,value,unit,commit (no header; plots/profiles.sh writes it). Metrics a
report lacks are left out, not invented.
"""
import argparse
import csv
import re
import sys

METRICS = [
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "launch__grid_size",
    "launch__block_size",
    "launch__registers_per_thread",
    "launch__shared_mem_per_block_dynamic",
    "launch__occupancy_limit_registers",
    "launch__occupancy_limit_shared_mem",
    "launch__occupancy_limit_warps",
    "sm__maximum_warps_per_active_cycle_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "smsp__inst_executed_op_ldsm.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum",
    "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
]
# Every stall reason, in cycles per issued instruction.
PATTERNS = [re.compile(r"^smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active\.ratio$")]


def kernel_name(demangled):
    """'void backward_dk_dv<64, true>(const __half *, ...)' -> 'backward_dk_dv'."""
    name = demangled.split("(")[0].strip()
    if name.startswith("void "):
        name = name[len("void "):]
    return name.split("<")[0].strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw")
    parser.add_argument("--gpu", required=True)
    parser.add_argument("--build", required=True)
    parser.add_argument("--dim", required=True)
    parser.add_argument("--commit", required=True)
    args = parser.parse_args()
    with open(args.raw, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    # ncu may print lines such as "==PROF==" before the table: start at the header row.
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if start is None or len(rows) < start + 3:
        sys.exit(f"ncu_metrics: no kernels in {args.raw}")
    header, units, data = rows[start], rows[start + 1], rows[start + 2:]
    wanted = [m for m in header if m in METRICS or any(p.match(m) for p in PATTERNS)]
    missing = [m for m in METRICS if m not in header]
    if missing:
        print(f"ncu_metrics: {args.build} D={args.dim}: not in the report: {', '.join(missing)}", file=sys.stderr)
    out = csv.writer(sys.stdout, lineterminator="\n")
    seen = {}
    for row in data:
        kernel = kernel_name(row[header.index("Kernel Name")])
        seen[kernel] = seen.get(kernel, 0) + 1
        if seen[kernel] > 1:  # a kernel launched twice in one run: number the launches
            kernel = f"{kernel}#{seen[kernel]}"
        for metric in wanted:
            i = header.index(metric)
            value = row[i].replace(",", "")
            try:
                float(value)
            except ValueError:
                continue
            out.writerow([args.gpu, args.build, kernel, args.dim, metric, value, units[i], args.commit])


if __name__ == "__main__":
    main()
