#!/usr/bin/env python3
"""merge_rows.py NEW INTO - the benchmark run in parts: put NEW's rows into the CSV INTO.

Every row of INTO whose program (the `stage` column: a stage, a build such as
09_tma_wgmma.fwd_step3, or a peer) and direction NEW measured is replaced by NEW's rows of that
program and direction; the other rows stay (a ladder run that times the previous stage's forward
leaves that stage's backward rows as they were). The result is in the benchmark's own order: the
stages' forward rows, their backward rows, then the peers' forward and backward rows, each program's
shapes in the order it measured them. plots/bench.sh --merge and plots/ablations.py --merge use
it, where one command may not run the whole benchmark (a GPU lent for minutes at a time); the
commit column still says which commit measured each row.
"""
import csv
import pathlib
import re
import sys


def read_rows(path):
    path = pathlib.Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return None, []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def merged(new_rows, old_rows):
    """old_rows without the programs and directions new_rows measured, plus new_rows, in the
    benchmark's order."""
    measured = {(row["stage"], row["direction"]) for row in new_rows}
    rows = [row for row in old_rows if (row["stage"], row["direction"]) not in measured] + list(new_rows)
    first_seen = {}
    for row in rows:
        first_seen.setdefault(row["stage"], len(first_seen))

    def order(row):
        is_peer = not re.match(r"^\d\d_", row["stage"])
        # Stages by name (their numbers are the course's order); peers as they first appear.
        return is_peer, row["direction"] == "bwd", "" if is_peer else row["stage"], first_seen[row["stage"]]

    return sorted(rows, key=order)  # stable: each program's shapes keep their order


def merge(new_path, into_path):
    fields, new_rows = read_rows(new_path)
    old_fields, old_rows = read_rows(into_path)
    fields = fields or old_fields
    if fields is None:
        return 0
    with open(into_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(merged(new_rows, old_rows))
    return len(new_rows)


def self_test():
    """A merge of one program's forward rows replaces its forward rows only, and a program NEW did
    not measure stays; returns 0 when both hold (CTest merge_rows_self_test)."""
    def row(stage, direction, tflops):
        return {"stage": stage, "direction": direction, "tflops": tflops}
    old = [row("10_x", "fwd", "1"), row("10_x", "bwd", "2"), row("11_y", "fwd", "3")]
    got = [(r["stage"], r["direction"], r["tflops"]) for r in merged([row("10_x", "fwd", "4")], old)]
    want = [("10_x", "fwd", "4"), ("11_y", "fwd", "3"), ("10_x", "bwd", "2")]
    print("merge_rows self-test:", "ok" if got == want else f"FAILED: {got} != {want}")
    return 0 if got == want else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    if len(sys.argv) != 3:
        print(__doc__.strip().split("\n\n")[0], file=sys.stderr)
        sys.exit(2)
    merge(sys.argv[1], sys.argv[2])
