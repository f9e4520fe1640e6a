#!/usr/bin/env python3
"""fp8_accuracy.py --csv OUT - FlashAttention-3's FP8 accuracy experiment (Shah et al. 2024,
section 4.3) on this GPU: the RMSE of O against the float64 reference for stage 10 in fp16 and
for stage 11's ladder steps that change the numerics (one scale per tensor; a scale per block of
128 rows; and, as built, Q and K rotated by a Hadamard transform first), on inputs drawn from
N(0, 1) and from N(0, 1) + N(0, 100) Bernoulli(0.001) (the harness's --outliers). One row per
program and inputs, written to OUT (the benchmark writes plots/data/<gpu>_fp8_accuracy.csv); the
lesson of stage 11 and its chart read it.

The RMSE is the harness's own (its check line): over the rows it compares with the reference, all
of them where the problem is small, a fixed sample of every head's rows otherwise. Needs
FLASH_STAGES_BIN (default build/bin) with the ladder steps built (the full preset).
"""
import argparse
import csv
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (program, method): the fp16 baseline, then the FP8 methods in the ladder's order.
PROGRAMS = [("10_fa3_schedule", "fp16"),
            ("11_fp8.fwd_step0", "e4m3, one scale per tensor"),
            ("11_fp8.fwd_step1", "e4m3, a scale per 128 rows"),
            ("11_fp8", "e4m3, a scale per 128 rows, Q and K rotated")]
INPUTS = [("normal", []), ("outliers", ["--outliers"])]
SHAPE = {"batch": 4, "heads": 8, "seq": 1024, "dim": 128}
CHECK = re.compile(r"max abs err ([0-9.e+-]+), rel L2 err ([0-9.e+-]+), RMSE ([0-9.e+-]+)")
HEADER = ["gpu", "program", "method", "inputs", "batch", "heads", "seq", "dim", "causal", "rmse", "rel_l2_err",
          "max_abs_err", "commit"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", required=True)
    args = parser.parse_args()
    binaries = pathlib.Path(os.environ.get("FLASH_STAGES_BIN", ROOT / "build" / "bin"))
    commit = os.environ.get("FLASH_STAGES_COMMIT", "unknown")
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.splitlines()[0].replace(",", " ")
    rows, failures = [], 0
    for inputs, flags in INPUTS:
        for program, method in PROGRAMS:
            command = [str(binaries / program), "--batch", str(SHAPE["batch"]), "--heads", str(SHAPE["heads"]),
                       "--seq", str(SHAPE["seq"]), "--dim", str(SHAPE["dim"])] + flags
            run = subprocess.run(command, capture_output=True, text=True)
            if run.returncode == 77:  # not a Hopper GPU: the FP8 stage (and stage 10) cannot run here
                print(f"fp8_accuracy: {program} {inputs}: skipped: {run.stdout.strip()}")
                continue
            found = CHECK.search(run.stdout)
            if run.returncode != 0 or not found:
                print(f"fp8_accuracy: {program} {inputs}: FAILED (exit {run.returncode})\n{run.stdout}{run.stderr}",
                      file=sys.stderr)
                failures += 1
                continue
            max_abs, rel_l2, rmse = found.groups()
            print(f"fp8_accuracy: {program:18s} {inputs:8s} RMSE {rmse}")
            rows.append([gpu, program, method, inputs, SHAPE["batch"], SHAPE["heads"], SHAPE["seq"], SHAPE["dim"], 0,
                         rmse, rel_l2, max_abs, commit])
    if not rows and not failures:
        print(f"fp8_accuracy: no program ran on this GPU; {args.csv} left as it was")
        return 0
    with open(args.csv, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(HEADER)
        writer.writerows(rows)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
