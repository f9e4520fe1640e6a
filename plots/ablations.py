#!/usr/bin/env python3
"""ablations.py [--ladders] [--merge] --csv OUT STAGE... - time every given stage that has ablation
builds (stages/<stage>/ablations.txt) and each of those builds, in the passes each build changes,
and write the rows to OUT (the benchmark writes plots/data/<gpu>_ablations.csv): the lessons'
tables "what each idea is worth" come from it.

Each build is timed at B*S = 16384 tokens and H*D = 2048 at S = 4096, or at the sequence lengths
the file names ("# sequence lengths: ..."), with D = 64 and 128, causal and not; and at the small
shape where the file names one ("# small shape: B H S D").

With --ladders, times the steps of each given stage's ladder (stages/<stage>/ladder.txt) instead,
at S = 4096: the previous stage, every step of each pass, and the stage as built (the last step),
for the lessons' ladder tables (the benchmark writes plots/data/<gpu>_ladders.csv).

With --merge, the rows go into OUT in place of the rows of the same programs (plots/merge_rows.py),
and the rest of OUT stays: for a benchmark run in parts.

plots/bench.sh runs this after the sweep; run alone, it needs FLASH_STAGES_BIN (default
build/bin) to hold the built programs (the full preset builds them). Every measurement is checked
against the float64 reference before it is timed (the harness does both); the exit status is
non-zero if a check failed.
"""
import argparse
import os
import pathlib
import subprocess
import sys
import time

from merge_rows import merge
from tables import ROOT, previous_stage, read_ablations, read_ladder


def shapes(listed):
    """(B, H, S, D, causal) of every measurement of one build."""
    for seq in listed["seqs"]:
        for dim in (64, 128):
            for causal in (0, 1):
                yield 16384 // seq, 2048 // dim, seq, dim, causal
    if listed["small"]:
        for causal in (0, 1):
            yield listed["small"] + (causal,)


def ablation_runs(stage):
    """(program, direction, shapes) of a stage's ablation table: the stage as built, forward (and
    backward where a build changes the backward), then each build in the passes it changes."""
    listed = read_ablations(stage)
    if listed is None:
        return []
    measured = list(shapes(listed))
    runs = [(stage, "fwd")] + [(stage, "bwd")] * any("bwd" in b["passes"] for b in listed["builds"])
    runs += [(f"{stage}.{b['name']}", p) for b in listed["builds"] for p in b["passes"]]
    return [(program, direction, measured) for program, direction in runs]


def ladder_runs(stage):
    """(program, direction, shapes) of a stage's ladder tables: per pass, the previous stage where
    it has that pass, every step, and the stage as built, at S = 4096."""
    ladder = read_ladder(stage)
    if ladder is None:
        return []
    measured = list(shapes({"seqs": [4096], "small": None}))
    previous = previous_stage(stage)
    runs = []
    for direction, steps in ladder.items():
        if previous and (direction == "fwd" or (ROOT / "stages" / previous / "backward.cu").exists()):
            runs.append((previous, direction))
        runs += [(f"{stage}.{direction}_step{k}", direction) for k in range(len(steps["ideas"]))]
        runs.append((stage, direction))
    return [(program, direction, measured) for program, direction in runs]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", required=True, help="the CSV to write (replaced once every build is timed)")
    parser.add_argument("--ladders", action="store_true", help="time the ladder steps instead of the ablation builds")
    parser.add_argument("--merge", action="store_true", help="replace only the rows of the programs timed")
    parser.add_argument("stages", nargs="+", metavar="STAGE")
    args = parser.parse_args()
    bin_dir = pathlib.Path(os.environ.get("FLASH_STAGES_BIN", ROOT / "build" / "bin"))
    out = pathlib.Path(args.csv)
    partial = out.with_name(out.name + ".partial")
    partial.unlink(missing_ok=True)
    start, failures = time.monotonic(), 0
    what = "ladders" if args.ladders else "ablations"
    for stage in args.stages:
        for program, direction, measured in (ladder_runs if args.ladders else ablation_runs)(stage):
            for B, H, S, D, causal in measured:
                flags = ["--batch", str(B), "--heads", str(H), "--seq", str(S), "--dim", str(D),
                         "--bench", "--csv", str(partial)] + ["--causal"] * causal + ["--backward"] * (direction == "bwd")
                run = subprocess.run([str(bin_dir / program)] + flags, capture_output=True, text=True)
                label = (f"[{time.monotonic() - start:4.0f}s] {program:<48} {direction} B={B:<2} S={S:<5} D={D:<3} "
                         f"{'causal' if causal else '':<6}")
                log = run.stdout + run.stderr
                if run.returncode == 0:
                    times = [line.split(":", 1)[1].strip() for line in log.splitlines() if line.startswith("time")]
                    print(f"{label} {' '.join(times)}", flush=True)
                elif run.returncode in (3, 77):  # a shape or a GPU the build cannot run: said, not failed
                    print(f"{label} skipped: {(log.strip().splitlines() or [''])[-1]}", flush=True)
                else:
                    print(f"{label} FAILED (exit {run.returncode}):\n" + "".join(f"    {line}\n" for line in log.splitlines()),
                          end="", flush=True)
                    failures += 1
    if partial.exists():
        if args.merge:
            merge(partial, out)
            partial.unlink()
        else:
            partial.replace(out)
        rows = sum(1 for _ in open(out)) - 1
        print(f"{what}: {out} has {rows} rows; this run took {time.monotonic() - start:.0f} s")
    if failures:
        print(f"{what}: {failures} measurement(s) FAILED", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
