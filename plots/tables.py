#!/usr/bin/env python3
"""tables.py - every measured table of the course, generated from the committed CSVs.

    python3 plots/tables.py --update       rewrite the tables in README.md, the lessons, docs/ and
                                           the report pages plots/<gpu>.md
    python3 plots/tables.py --check        fail if any of them differs from what the CSVs give (a
                                           CTest test, so a table never drifts from the data)
    python3 plots/tables.py --report CSV OUT
                                           every table of the README and the lessons from another
                                           GPU's CSV (plots/data/<gpu>.csv), as one page OUT
    python3 plots/tables.py --roofline CSV the roofline's points of that GPU, one line per stage and
                                           D, for plots/roofline.gp
    python3 plots/tables.py --fp8-accuracy CSV
                                           the FP8 accuracy experiment's RMSEs, one line per method,
                                           for plots/fp8_accuracy.gp

A table lives in a Markdown file between <!-- measured:KEY:begin --> and <!-- measured:KEY:end -->;
KEY is "course" (and "roofline", "training") in README.md and the stage's name, or the stage's name
and a suffix, in a lesson or in the lesson's notes (stages/<stage>/notes.md). The H100's CSVs feed the README and the lessons; every GPU's CSV feeds
its own report page. One CSV loader (read_csv), one sweep filter (on_sweep), one table writer
(markdown_table) and one reader of stages/<stage>/ablations.txt (read_ablations) serve them all.
"""

import csv
import functools
import os
import pathlib
import re
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
H100 = "plots/data/h100.csv"
# The H200's CSV: the lessons' ladder tables (ladder_table) come from its run (the "ladders"
# companion of its CSV), and a lesson's sweep tables too where the H100 never measured its stage.
H200 = "plots/data/h200.csv"


# Stages whose kernels changed after the H100's run: their lessons' sweep tables come from the
# H200's, where the code as it is was measured beside its peers.
MEASURED_ON_H200 = {"08_warp_specialized"}


def lesson_gpu(stage):
    """The CSV of a lesson's sweep tables: the H100's, or the H200's for a stage written after the
    H100's run or changed since."""
    if stage in MEASURED_ON_H200:
        return H200
    return H100 if any(r["stage"] == stage for r in read_csv(H100)) else H200
SEQS = [512 * 2**i for i in range(6)]  # the sweep: S = 512 ... 16384
CELLS = [(64, 0), (64, 1), (128, 0), (128, 1)]  # the D x causal columns of every sweep table
CELL_HEADER = ["D=64", "D=64 causal", "D=128", "D=128 causal"]


# ---------------------------------------------------------------------------------------------
# Shared pieces.

@functools.lru_cache(maxsize=None)
def read_csv(path):
    """The rows of a committed CSV as dicts of strings, or [] where the file is missing; read once,
    and shared by the tables (none changes them)."""
    path = ROOT / path
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def companion(csv_path, kind):
    """The same GPU's other CSV: plots/data/<gpu>_<kind>.csv."""
    return str(csv_path)[: -len(".csv")] + f"_{kind}.csv"


def num(row, column):
    return float(row[column])


def on_sweep(row):
    """The FlashAttention papers' sweep: B*S = 16384 tokens, H*D = 2048."""
    return int(row["batch"]) * int(row["seq"]) == 16384 and int(row["heads"]) * int(row["dim"]) == 2048


def key_of(row):
    """(stage, S, D, causal, direction) of a benchmark row."""
    return row["stage"], int(row["seq"]), int(row["dim"]), int(row["causal"]), row["direction"]


def commits(rows, column="commit"):
    """The commits of the rows, in the order they first appear."""
    return ", ".join(dict.fromkeys(row[column] for row in rows))


def runs_of(stage, stage_rows, peer, peer_rows):
    """(whether one run measured a stage's rows and its peer's, words naming the commits): "commit
    X", or "<stage> at commit X, <peer> at Y" where they differ; no peer rows count as one run."""
    mine, theirs = commits(stage_rows), commits(peer_rows)
    if mine == theirs or not theirs:
        return True, f"commit {mine}"
    return False, f"{stage} at commit {mine}, {peer} at {theirs}"


def markdown_table(header, rows, align=None):
    """Lines of a Markdown table; align: one '---' or '---:' per column (default: the first left,
    the rest right)."""
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def read_ablations(stage):
    """stages/<stage>/ablations.txt: its builds (name, passes, what the build changes), the
    sequence lengths they are timed and shown at ("# sequence lengths: ...", default 4096), the
    small shape they are also timed at ("# small shape: B H S D", or None) and the PyTorch peer
    the table compares with ("# compare with: ..."), or None without the file. plots/ablations.py
    times what it lists; CMakeLists.txt reads the -D definitions, which only the build needs."""
    path = ROOT / "stages" / stage / "ablations.txt"
    if not path.exists():
        return None
    builds, seqs, small, peer = [], [4096], None, ""
    for line in path.read_text().splitlines():
        if line.startswith("# sequence lengths:"):
            seqs = [int(s) for s in line.split(":", 1)[1].split()]
        elif line.startswith("# small shape:"):
            small = tuple(int(s) for s in line.split(":", 1)[1].split())
        elif line.startswith("# compare with:"):
            peer = line.split(":", 1)[1].strip()
        elif line.strip() and not line.startswith("#"):
            fields = [f.strip() for f in line.split("|")]
            builds.append({"name": fields[0], "passes": fields[1].split(), "what": fields[3]})
    return {"builds": builds, "seqs": seqs, "small": small, "peer": peer}


def ablations_gpu(stage):
    """The CSV whose ablations companion holds a stage's ablation builds: the H100's, or the H200's
    for a stage whose builds only the H200 measured."""
    return H100 if any(r["stage"].split(".")[0] == stage for r in read_csv(companion(H100, "ablations"))) else H200


def previous_stage(stage):
    """The folder of the stage before `stage` in the course (stages/<NN-1>_*), or "" for the first."""
    found = sorted(p.name for p in (ROOT / "stages").glob(f"{int(stage[:2]) - 1:02d}_*"))
    return found[0] if found else ""


def read_ladder(stage):
    """stages/<stage>/ladder.txt: per pass ("fwd", "bwd"), what step 0 is and the ideas in the
    order they are switched on (name, the -D definitions that switch each off, the idea); or None
    without the file. Step k of a pass is the build <stage>.<pass>_step<k>, which has that pass's
    ideas k + 1, k + 2, ... switched off; the step after the last idea is the stage as built."""
    path = ROOT / "stages" / stage / "ladder.txt"
    if not path.exists():
        return None
    ladder = {}
    for line in path.read_text().splitlines():
        step0 = re.match(r"^# step 0 \((fwd|bwd)\): (.*)$", line)
        if step0:
            ladder.setdefault(step0.group(1), {"base": "", "ideas": []})["base"] = step0.group(2)
        elif line.strip() and not line.startswith("#"):
            name, pass_, definitions, idea = (f.strip() for f in line.split("|"))
            ladder.setdefault(pass_, {"base": "", "ideas": []})["ideas"].append(
                {"name": name, "definitions": definitions.split(), "idea": idea})
    return ladder


def no_data(path, what="H100 measurements"):
    return [f"_No {what} committed yet ({path})._"]


# ---------------------------------------------------------------------------------------------
# The roofline: where each stage's forward pass sits against the GPU's measured ceilings.

def roofline_points(csv_path):
    """(stage, D, intensity, tflops, ceiling, percent, bound) per stage and D at S = 4096, B = 4,
    H*D = 2048, non-causal: intensity in FLOPs (4 B H S^2 D) per byte of DRAM traffic that Nsight
    Compute counted over the forward's kernels (plots/profiles.sh); ceiling the lower of the peak
    of the units that compute QKᵀ (FP32 CUDA cores for stages 01-04, tensor cores from 05) and
    intensity x copy bandwidth (plots/ceilings.py); bound what sets it. Stages without a profile
    give none."""
    ceilings = {row["ceiling"]: float(row["value"]) for row in read_csv(companion(csv_path, "ceilings"))}
    bandwidth = ceilings.get("copy_bandwidth")  # GB/s
    peak = {"simt": ceilings.get("fp32_simt_matmul"), "tc": ceilings.get("fp16_tensor_core_matmul")}
    dram = {}
    for row in read_csv(companion(csv_path, "profiles")):
        if row["metric"] in ("dram__bytes_read.sum", "dram__bytes_write.sum") and not row["kernel"].startswith("backward"):
            key = row["build"], int(row["dim"])
            dram[key] = dram.get(key, 0.0) + float(row["value"])
    points = []
    for row in read_csv(csv_path):
        stage, S, D, causal, direction = key_of(row)
        if (direction != "fwd" or int(row["batch"]) != 4 or S != 4096 or causal or not on_sweep(row)
                or not re.match(r"^\d\d_", stage) or bandwidth is None or dram.get((stage, D), 0) <= 0):
            continue
        intensity = 4 * int(row["batch"]) * int(row["heads"]) * S * S * D / dram[stage, D]
        unit = "simt" if int(stage[:2]) <= 4 else "tc"
        ceiling, bound = intensity * bandwidth / 1000, "bandwidth"
        if peak[unit] is not None and peak[unit] < ceiling:
            ceiling, bound = peak[unit], "tensor_cores" if unit == "tc" else "fp32_cores"
        tflops = num(row, "tflops")
        points.append((stage, D, f"{intensity:.1f}", f"{tflops:.3f}", f"{ceiling:.1f}",
                       f"{100 * tflops / ceiling:.1f}", bound))
    return points


def roofline_table(csv_path):
    profiles, ceilings = companion(csv_path, "profiles"), companion(csv_path, "ceilings")
    if not (ROOT / profiles).exists() or not (ROOT / ceilings).exists():
        return [f"_Not measured yet ({profiles}, {ceilings})._"]
    rows = [(stage, D, intensity, f"{float(tflops):.1f}", f"{ceiling} ({bound.replace('_', ' ').replace('fp32', 'FP32')})",
             percent) for stage, D, intensity, tflops, ceiling, percent, bound in roofline_points(csv_path)]
    return ["Forward at S = 4096, B = 4, H*D = 2048, non-causal. Intensity: FLOPs per byte of DRAM traffic that",
            f"Nsight Compute counted (`{profiles}`); TFLOP/s from `{csv_path}`; ceiling: the lower of the peak of",
            "the units that compute QKᵀ (FP32 CUDA cores for 01–04, tensor cores from 05) and intensity × copy",
            f"bandwidth (`{ceilings}`):", ""] + markdown_table(
        ["stage", "D", "FLOP per DRAM byte", "TFLOP/s", "ceiling (TFLOP/s)", "% of ceiling"], rows,
        ["---", "---:", "---:", "---:", "---:", "---:"])


# ---------------------------------------------------------------------------------------------
# Tables of the benchmark's sweep.

def course_table(csv_path):
    """Each stage and peer: forward TFLOP/s at S = 4096 on the sweep, the small shape's latency,
    and (with a profile) the % of the measured ceiling; then the backward at S = 4096."""
    rows = read_csv(csv_path)
    if not rows:
        return no_data(csv_path)
    percent = {(p[0], p[1]): p[5] for p in roofline_points(csv_path)}
    fwd = [r for r in rows if r["direction"] == "fwd"]
    tf, small = {}, {}
    for r in fwd:
        stage, S, D, causal, _ = key_of(r)
        if on_sweep(r) and S == 4096:
            tf[stage, D, causal] = f"{num(r, 'tflops'):.1f}"
        if (int(r["batch"]), int(r["heads"]), S, D, causal) == (1, 8, 512, 64, 0):
            small[stage] = f"{num(r, 'median_us'):.1f}"
    names = list(dict.fromkeys(r["stage"] for r in fwd))
    header = ["stage"] + CELL_HEADER + ["B=1 H=8 S=512 D=64 (us)"]
    table = []
    for n in names:
        row = [n] + [tf.get((n, D, c), "-") for D, c in CELLS] + [small.get(n, "-")]
        if percent:
            row.append(f"{percent[n, 64]} / {percent[n, 128]}" if (n, 64) in percent else "-")
        table.append(row)
    if percent:
        header.append("% of measured ceiling, D=64 / D=128")
    lines = [f"Forward TFLOP/s at S = 4096 (B = 4, H*D = 2048) and latency of the small shape, {fwd[-1]['gpu']},",
             f"from `{csv_path}` (commit {commits(fwd)}):", ""] + markdown_table(header, table)
    missing = [p.name for p in sorted((ROOT / "stages").glob("[0-9][0-9]_*")) if p.name not in names]
    if missing:
        lines += ["", f"Not measured in this run: {', '.join(missing)} (written after it; see the other GPUs' pages, "
                      "`plots/<gpu>.md`)."]
    bwd = [r for r in rows if r["direction"] == "bwd" and on_sweep(r) and int(r["seq"]) == 4096]
    if not bwd:
        return lines
    btf = {(r["stage"], int(r["dim"]), int(r["causal"])): f"{num(r, 'tflops'):.1f}" for r in bwd}
    table = [[n] + [btf.get((n, D, c), "-") for D, c in CELLS] for n in dict.fromkeys(r["stage"] for r in bwd)]
    return lines + ["", "Backward TFLOP/s at S = 4096 (FLOPs 2.5x the forward):", ""] + markdown_table(
        ["stage"] + CELL_HEADER, table)


def stage_table(csv_path, stage, direction):
    """A stage's TFLOP/s over the whole sweep in one direction, with SDPA flash's beside it."""
    rows = read_csv(csv_path)
    if not rows:
        return no_data(csv_path)
    tf, seqs, gpu, used = {}, set(), "", {stage: [], "sdpa_flash": []}
    for r in rows:
        if r["direction"] == direction and on_sweep(r):
            name, S, D, causal, _ = key_of(r)
            if name in (stage, "sdpa_flash"):
                tf[name, S, D, causal] = f"{num(r, 'tflops'):.2f}"
                seqs.add(S)
                used[name].append(r)
            gpu = r["gpu"]
    if (stage, 4096, 64, 0) not in tf and (stage, 4096, 128, 0) not in tf:
        return [f"_Not measured in `{csv_path}`._"]
    name = "the H100" if "H100" in gpu else f"the {gpu}"
    table = [[S] + [f"{tf.get((stage, S, D, c), 'skipped')} ({tf.get(('sdpa_flash', S, D, c), 'skipped')})"
                    for D, c in CELLS] for S in SEQS if S in seqs]
    _, run = runs_of(stage, used[stage], "SDPA flash", used["sdpa_flash"])
    return [f"{'Forward' if direction == 'fwd' else 'Backward'} TFLOP/s on {name} (B*S = 16384, H*D = 2048), "
            f"from `{csv_path}` ({run}); in brackets PyTorch SDPA flash:", ""] + markdown_table(
        ["S"] + CELL_HEADER, table, ["---:"] * 5)


def ratio_table(csv_path, stage, peer, direction="fwd", first=2048):
    """A stage's TFLOP/s over a peer's, shape by shape, from S = first on; the lowest in bold."""
    rows = read_csv(csv_path)
    if not rows:
        return no_data(csv_path)
    used = [r for r in rows if r["direction"] == direction and on_sweep(r) and int(r["seq"]) >= first]
    tf = {key_of(r)[:4]: num(r, "tflops") for r in used}
    seqs = [S for S in SEQS if S >= first]
    ratio = {(S, D, c): tf[stage, S, D, c] / tf[peer, S, D, c] for D, c in CELLS for S in seqs
             if (stage, S, D, c) in tf and (peer, S, D, c) in tf}
    lowest = min(ratio, key=ratio.get) if ratio else None  # the first of equal ratios
    table = []
    for D, c in sorted(CELLS, key=lambda cell: (cell[1], cell[0])):  # the masks, then D
        cells = []
        for S in seqs:
            x = f"{ratio[S, D, c]:.3f}" if (S, D, c) in ratio else "-"
            cells.append(f"**{x}**" if (S, D, c) == lowest else x)
        table.append([f"D = {D}{' causal' if c else ''}"] + cells)
    one_run, run = runs_of(stage, [r for r in used if r["stage"] == stage], peer,
                           [r for r in used if r["stage"] == peer])
    source = f"from {'the same run' if one_run else 'two runs'} (`{csv_path}`, {run})"
    return [f"Ratios {stage} / {peer}, {'forward' if direction == 'fwd' else 'backward'}, {source}; "
            "the lowest in bold:", ""] + markdown_table(
        [f"{stage} / {peer}", f"S = {seqs[0]}"] + [str(S) for S in seqs[1:]], table)


def bf16_ratios(csv_path):
    """{(stage, direction, S, D, causal): bf16 TFLOP/s / fp16 TFLOP/s} on the sweep, from the GPU's
    <gpu>_bf16.csv, where bench.sh's bf16 part times both types of a shape one after the other."""
    tf = {}
    for r in read_csv(companion(csv_path, "bf16")):
        if on_sweep(r):
            name, S, D, causal, direction = key_of(r)
            tf[name, direction, S, D, causal, r["dtype"]] = num(r, "tflops")
    return {k[:5]: tf[k] / tf[k[:5] + ("fp16",)] for k in tf if k[5] == "bf16" and k[:5] + ("fp16",) in tf}


def bf16_table(csv_path, stage):
    """A stage's bf16 TFLOP/s over its fp16 TFLOP/s, shape by shape, both from one run; the lowest in
    bold. None where the stage has no bf16 rows."""
    ratio = {k[1:]: x for k, x in bf16_ratios(csv_path).items() if k[0] == stage}
    if not ratio:
        return None
    lowest = min(ratio, key=ratio.get)
    seqs = [S for S in SEQS if any(k[1] == S for k in ratio)]
    table = []
    for direction in ("fwd", "bwd"):
        for D, c in sorted(CELLS, key=lambda cell: (cell[1], cell[0])):
            if not any((direction, S, D, c) in ratio for S in seqs):
                continue
            cells = [f"**{ratio[k]:.3f}**" if k == lowest else f"{ratio[k]:.3f}" if k in ratio else "-"
                     for k in ((direction, S, D, c) for S in seqs)]
            table.append([f"{'forward' if direction == 'fwd' else 'backward'}, D = {D}{' causal' if c else ''}"]
                         + cells)
    return [f"bf16 / fp16, TFLOP/s of {stage} in each type, timed one after the other in one run "
            f"(`{companion(csv_path, 'bf16')}`); the lowest in bold:", ""] + markdown_table(
        ["bf16 / fp16"] + [f"S = {S}" for S in seqs], table)


def bf16_summary(csv_path):
    """One line per stage and pass: the range of bf16 / fp16 over the sweep, for the README."""
    ratios = bf16_ratios(csv_path)
    if not ratios:
        return no_data(companion(csv_path, "bf16"), "bf16 measurements")
    gpu = read_csv(companion(csv_path, "bf16"))[0]["gpu"]
    table = []
    for stage in dict.fromkeys(k[0] for k in ratios):
        for direction in ("fwd", "bwd"):
            xs = [x for k, x in ratios.items() if k[0] == stage and k[1] == direction]
            if xs:
                table.append([stage, "forward" if direction == "fwd" else "backward", f"{min(xs):.3f}",
                              f"{max(xs):.3f}", len(xs)])
    return [f"bf16 TFLOP/s over fp16 TFLOP/s on the {gpu}, each shape of the sweep timed in both types one "
            f"after the other (`{companion(csv_path, 'bf16')}`; every shape: [the report page]"
            f"(plots/{pathlib.Path(csv_path).stem}.md)):", ""] + markdown_table(
        ["stage", "pass", "lowest", "highest", "shapes"], table)


def ablation_table(csv_path, stage):
    """A stage's ablation builds (plots/ablations.py): TFLOP/s at each sequence length its
    ablations.txt names, of the stage as built and of each build with one idea switched off, with
    the ratio to the stage as built; the previous stage's as-built row, and the PyTorch peer that
    the file names, from the sweep of the same GPU's CSV."""
    listed = read_ablations(stage)
    if listed is None:
        return None
    path = companion(csv_path, "ablations")
    rows = read_csv(path)
    if not rows:
        return [f"_No ablation measurements committed yet ({path})._"]
    if not any(r["stage"] == stage for r in rows):
        return [f"_No ablation run of {stage} in `{path}`._"]
    peer = listed["peer"]
    tf, peer_rows = {}, []
    if peer:  # the peer from the sweep, at each sequence length's sweep shape (B * S = 16384)
        for r in read_csv(csv_path):
            if r["stage"] == peer and int(r["batch"]) * int(r["seq"]) == 16384:
                tf[key_of(r)] = num(r, "tflops")
                peer_rows.append(r)
    for r in rows:
        tf[key_of(r)] = num(r, "tflops")
    previous = previous_stage(stage)
    has_bwd = any("bwd" in b["passes"] for b in listed["builds"])

    def cell(build, seq, direction, D, c):
        if (build, seq, D, c, direction) not in tf:
            return "-"
        x = tf[build, seq, D, c, direction]
        if build == stage or (stage, seq, D, c, direction) not in tf:
            return f"{x:.1f}"
        return f"{x:.1f} ({x / tf[stage, seq, D, c, direction]:.2f}x)"

    def row(build, seq, label, direction, what=""):
        return [label, direction, what] + [cell(build, seq, direction, D, c) for D, c in CELLS]

    lines = []
    for seq in listed["seqs"]:
        table = [row(stage, seq, f"{stage} as built", "fwd")]
        if has_bwd:
            table.append(row(stage, seq, f"{stage} as built", "bwd"))
        for b in listed["builds"]:  # those this GPU's run timed (a build added later has no rows yet)
            if any(k[0] == f"{stage}.{b['name']}" for k in tf):
                table += [row(f"{stage}.{b['name']}", seq, f"`.{b['name']}`", p, b["what"]) for p in b["passes"]]
        if previous and (previous, seq, 64, 0, "fwd") in tf:
            table.append(row(previous, seq, f"{previous} as built (previous stage)", "fwd"))
        if peer:
            table.append(row(peer, seq, f"{peer} (PyTorch)", "fwd"))
            if has_bwd:
                table.append(row(peer, seq, f"{peer} (PyTorch)", "bwd"))
        if lines:
            lines.append("")
        lines += [f"TFLOP/s at S = {seq} (B = {16384 // seq}, H*D = 2048) on the {rows[-1]['gpu']}, one run of "
                  f"`plots/ablations.py`, from `{path}`; in brackets the ratio to the "
                  "stage as built" + (f" (for {peer}, from the sweep in `{csv_path}`, commit {commits(peer_rows)})"
                                     if peer else "")
                  + ":", ""]
        lines += markdown_table(["build", "pass", "what the build changes"] + CELL_HEADER, table,
                                ["---", "---", "---"] + ["---:"] * 4)
    return lines


# ---------------------------------------------------------------------------------------------
# The ladders: a stage's ideas switched on one at a time (stages/<stage>/ladder.txt).

def switch_lines(stage, definitions, page, most=2):
    """Links from the Markdown file `page` to the lines that read the switches of one idea: each
    macro's #ifndef, then the code lines that use the macro or its constant (SWIZZLE or kSwizzle)."""
    files = sorted((ROOT / "stages" / stage).glob("*.cu")) + sorted((ROOT / "stages" / stage).glob("*.h"))
    files += sorted((ROOT / "common").glob("*.cuh"))
    switches, found = [], []
    for definition in definitions:
        macro = definition.split("=")[0]
        constant = "k" + "".join(word.capitalize() for word in macro.split("_"))
        uses = re.compile(rf"\b({macro}|{constant})\b")
        for path in files:
            lines = path.read_text().splitlines()
            for number, line in enumerate(lines, 1):
                code = line.split("//")[0]
                if line.startswith(f"#ifndef {macro}"):
                    switches.append((path, number))
                elif (uses.search(code) and not code.startswith("#") and
                      not re.match(rf"^\s*(\[\[maybe_unused\]\] )?constexpr \w+ {constant}\b", code)):
                    found.append((path, number))
    found = list(dict.fromkeys(switches + sorted(found)))
    link = lambda path, number: f"[{path.name}:{number}]({os.path.relpath(path, (ROOT / page).parent)}#L{number})"
    shown = [link(*f) for f in found[:most]]
    return ", ".join(shown) + (f" and {len(found) - most} more" if len(found) > most else "")


def ladder_table(csv_path, stage, direction, page=None):
    """A stage's ladder in one pass: TFLOP/s at S = 4096 of the previous stage, of step 0 and of
    each step that switches one more idea on (the last is the stage as built), with the gain over
    the row above and links to the lines that read the idea's switch (relative to the Markdown file
    `page`, the lesson by default)."""
    ladder = read_ladder(stage)
    if ladder is None or direction not in ladder:
        return None
    path = companion(csv_path, "ladders")
    rows = read_csv(path)
    if not rows:
        return [f"_No ladder measurements committed yet ({path})._"]
    tf = {key_of(r): num(r, "tflops") for r in rows if int(r["seq"]) == 4096}
    run = {key_of(r): r["commit"] for r in rows if int(r["seq"]) == 4096}  # the run that measured a cell
    ideas = ladder[direction]["ideas"]
    previous = previous_stage(stage)
    programs = ([(previous, f"stage {previous[:2]}", "the previous stage, as built", "")]
                if previous and (previous, 4096, 64, 0, direction) in tf else [])
    programs.append((f"{stage}.{direction}_step0", "0", ladder[direction]["base"], ""))
    for k, idea in enumerate(ideas, 1):
        program = stage if k == len(ideas) else f"{stage}.{direction}_step{k}"
        label = f"{k} (the stage)" if k == len(ideas) else str(k)
        programs.append((program, label, idea["idea"],
                         switch_lines(stage, idea["definitions"], page or f"stages/{stage}/README.md")))
    table, above, runs = [], None, set()
    for program, label, idea, lines in programs:
        cells = []
        for D, c in CELLS:
            key, key_above = (program, 4096, D, c, direction), (above, 4096, D, c, direction)
            x, y = tf.get(key), tf.get(key_above) if above else None
            runs |= {run[key]} if x is not None else set()
            if x is None:
                cells.append("-")
            elif y is None:
                cells.append(f"{x:.1f}")
            elif run[key] != run[key_above]:  # no ratio across two runs
                cells.append(f"{x:.1f} (†)")
            else:
                cells.append(f"{x:.1f} ({x / y:.2f}x)")
        table.append([label, idea] + cells + [lines])
        above = program
    measured = ("one run of `plots/ablations.py --ladders`" if len(runs) <= 1 else
                f"{len(runs)} runs of `plots/ablations.py --ladders` (commits {', '.join(sorted(runs))}; † marks "
                "a row measured in another run than the row above, so no ratio is given)")
    return [f"{'Forward' if direction == 'fwd' else 'Backward'} TFLOP/s at S = 4096 (B = 4, H*D = 2048) on the "
            f"{rows[-1]['gpu']}, {measured}, from `{path}`; in brackets the ratio to "
            "the row above (below 1.00x: slower; within 3% of 1: noise):", ""] + \
        markdown_table(["step", "what the step adds (step 0: where it starts)"] + CELL_HEADER + ["the switch in the code"], table,
        ["---", "---"] + ["---:"] * 4 + ["---"])


# ---------------------------------------------------------------------------------------------
# The FP8 accuracy experiment (plots/fp8_accuracy.py): gpu,program,method,inputs,...,rmse,...
FP8_ACCURACY = "plots/data/h200_fp8_accuracy.csv"


def fp8_accuracy_points(path):
    """(method, RMSE on N(0,1), RMSE with outliers) per program, in the CSV's order."""
    rows = read_csv(path)
    by = {(r["program"], r["inputs"]): r for r in rows}
    programs = list(dict.fromkeys(r["program"] for r in rows))
    return [(by[p, "normal"]["method"] if (p, "normal") in by else p,
             by[p, "normal"]["rmse"] if (p, "normal") in by else "NaN",
             by[p, "outliers"]["rmse"] if (p, "outliers") in by else "NaN") for p in programs]


def fp8_accuracy_table(path):
    """Stage 11's accuracy experiment: RMSE of O per method, on N(0,1) and with 0.1% outliers."""
    rows = read_csv(path)
    if not rows:
        return no_data(path)
    first = rows[0]
    by_method = {method: program for program, method in
                 ((r["program"], r["method"]) for r in rows)}
    table = [[f"`{by_method[m]}`", m, normal, outliers] for m, normal, outliers in fp8_accuracy_points(path)]
    return [f"RMSE of O against the float64 reference on the {first['gpu']}, B = {first['batch']}, H = {first['heads']}, "
            f"S = {first['seq']}, D = {first['dim']}, non-causal, one run of `plots/fp8_accuracy.py` "
            f"(commit {first['commit']}), from `{path}`:", ""] + markdown_table(
        ["program", "method", "N(0,1)", "N(0,1) + N(0,100) Bernoulli(0.001)"], table, ["---", "---", "---:", "---:"])


# Tables of Nsight Compute's metrics (plots/profiles.sh): gpu,build,kernel,dim,metric,value,unit,commit.

STALL = re.compile(r"^smsp__average_warps_issue_stalled_(.*)_per_issue_active\.ratio$")


def profile_table(csv_path, stage):
    """The metrics the lessons quote, one column per profiled build, kernel and D of a stage."""
    path = companion(csv_path, "profiles")
    rows = read_csv(path)
    if not rows:
        return [f"_No profile committed yet ({path})._"]
    rows = [r for r in rows if r["build"] == stage or r["build"].startswith(stage + ".")]
    if not rows:
        return [f"_No profile of {stage} in the committed CSV._"]
    value, unit, stalls = {}, {}, {}
    for r in rows:
        key = r["build"], r["kernel"], r["dim"]
        value[key, r["metric"]], unit[key, r["metric"]] = r["value"], r["unit"]
        reason = STALL.match(r["metric"])
        if reason and reason.group(1) != "selected":
            stalls.setdefault(key, {})[reason.group(1)] = float(r["value"])
    keys = list(dict.fromkeys((r["build"], r["kernel"], r["dim"]) for r in rows))

    def cell(key, what):
        def has(metric):
            return (key, metric) in value
        if what == "time":
            if not has("gpu__time_duration.sum"):
                return "-"
            x, u = float(value[key, "gpu__time_duration.sum"]), unit[key, "gpu__time_duration.sum"]
            return f"{x if u == 'msecond' else x / 1e3 if u == 'usecond' else x / 1e6:.2f}"
        if what == "dram":
            if not has("dram__bytes_read.sum"):
                return "-"
            written = float(value.get((key, "dram__bytes_write.sum"), 0))
            return f"{(float(value[key, 'dram__bytes_read.sum']) + written) / 1e9:.2f}"
        if what.startswith("stall"):  # the largest stall reasons, in cycles per issued instruction
            ranked = sorted(stalls.get(key, {}).items(), key=lambda item: -item[1])
            rank = int(what[-1])
            return f"{ranked[rank - 1][0]} {ranked[rank - 1][1]:.2f}" if len(ranked) >= rank else "-"
        if not has(what):
            return "-"
        x = float(value[key, what])
        return f"{x / 1e6:.1f}" if what.endswith("sum") else f"{int(x)}" if what.startswith("launch__") else f"{x:.1f}"

    metrics = [
        ("duration under ncu (ms)", "time"),
        ("compute (SM) throughput, % of peak", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
        ("memory throughput, % of peak", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
        ("DRAM throughput, % of peak", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
        ("DRAM traffic (GB)", "dram"),
        ("registers per thread", "launch__registers_per_thread"),
        ("blocks per SM the registers allow", "launch__occupancy_limit_registers"),
        ("blocks per SM the shared memory allows", "launch__occupancy_limit_shared_mem"),
        ("theoretical occupancy, %", "sm__maximum_warps_per_active_cycle_pct"),
        ("achieved occupancy, %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
        ("issue slots busy, %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
        ("FMA pipe active, %", "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"),
        ("tensor (mma.sync) pipe active, %", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
        ("shared-load wavefronts (M)", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"),
        ("shared-load bank conflicts (M)", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"),
        ("top stall, cycles per issued instruction", "stall1"),
        ("second stall", "stall2"),
    ]
    columns = [("" if build == stage else f"`{build[len(stage):]}` ") + f"`{kernel}` D={dim}" for build, kernel, dim in keys]
    slug = pathlib.Path(csv_path).stem
    return [f"Nsight Compute on the {rows[-1]['gpu']} (`plots/profiles.sh`), S = 4096, B = 4, "
            f"H*D = 2048, non-causal; every kernel of one run. Full pages in `docs/profiles/{stage}_{slug}_ncu.txt`, "
            f"metrics in `{path}`:", ""] + markdown_table(
        ["metric"] + columns, [[label] + [cell(k, what) for k in keys] for label, what in metrics])


def peer_profile_table(csv_path, *specs, dims=(64, 128)):
    """A stage's kernels beside a PyTorch peer's, from the same Nsight Compute run: one column per
    BUILD:KERNEL spec and D (of dims), KERNEL matched as a part of the kernel's name."""
    path = companion(csv_path, "profiles")
    rows = read_csv(path)
    if not rows:
        return [f"_No profile committed yet ({path})._"]
    specs = [spec.split(":") for spec in specs]
    value, name, found_dims, matched, gpu = {}, {}, set(), [[] for _ in specs], ""
    for r in rows:
        for i, (build, kernel) in enumerate(specs):
            if r["build"] == build and kernel in r["kernel"]:
                value[i, int(r["dim"]), r["metric"]] = float(r["value"])
                name[i] = r["kernel"]
                found_dims.add(int(r["dim"]))
                matched[i].append(r)
                gpu = r["gpu"]
    if not set(dims) <= found_dims:
        return [f"_No profile of {' '.join(':'.join(s) for s in specs)} in the committed CSV._"]
    columns = []
    for D in dims:
        for i, (build, kernel) in enumerate(specs):
            label = re.sub(r"^.*::", "", name[i])
            columns.append(f"{build} `{label if len(label) <= 40 else kernel + '…'}` D={D}")

    def shown(x, digits):  # counts (no digits) truncated, as C's %d
        return str(int(x)) if digits == 0 else f"{x:.{digits}f}"

    def row(label, metric, scale, digits):
        return [label] + [shown(value[i, D, metric] / scale, digits) if (i, D, metric) in value else "-"
                          for D in dims for i in range(len(specs))]

    metrics = [("duration under ncu (ms)", "gpu__time_duration.sum", 1e6, 2),
               ("grid (blocks)", "launch__grid_size", 1, 0),
               ("threads per block", "launch__block_size", 1, 0),
               ("shared memory per block (bytes)", "launch__shared_mem_per_block_dynamic", 1, 0),
               ("registers per thread", "launch__registers_per_thread", 1, 0),
               ("shared-load wavefronts (M)", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum", 1e6, 1),
               ("shared-store wavefronts (M)", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum", 1e6, 1),
               ("L1 (shared memory) throughput, % of peak", "l1tex__throughput.avg.pct_of_peak_sustained_active", 1, 1),
               ("tensor pipe active, %", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", 1, 1),
               ("issue slots busy, %", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1, 1)]
    runs = ", ".join(dict.fromkeys(f"{r['build']} at {r['commit']}" for rows_of_spec in matched for r in rows_of_spec))
    return [f"Nsight Compute on the {gpu} (`plots/profiles.sh`; {runs}), S = 4096, B = 4, "
            f"H*D = 2048, non-causal, one run of each program; metrics in `{path}`:", ""] + markdown_table(
        ["metric"] + columns, [row(*m) for m in metrics])


def occupancy_table(csv_path):
    """Stage 04's experiment: stage 03, stage 03 with stage 04's shared memory per block (unused),
    and stage 04; speed from the ablation run, resources and occupancy from the profile."""
    ablations, profiles = companion(csv_path, "ablations"), companion(csv_path, "profiles")
    rows, metrics = read_csv(ablations), read_csv(profiles)
    if not rows or not metrics:
        return [f"_Not measured yet ({ablations}, {profiles})._"]
    m = {(r["build"], r["dim"], r["metric"]): r["value"] for r in metrics}
    timed = [r for r in rows if r["direction"] == "fwd" and r["causal"] == "0"]
    tf = {(r["stage"], r["dim"]): num(r, "tflops") for r in timed}

    def get(build, D, metric):
        return m.get((build, str(D), metric), "-")

    table = []
    for D in (64, 128):
        for build in ("03_online_softmax", "03_online_softmax.smem_of_04", "04_smem_state"):
            achieved = get(build, D, "sm__warps_active.avg.pct_of_peak_sustained_active")
            table.append([build, D, f"{tf[build, str(D)]:.2f}" if (build, str(D)) in tf else "-",
                          get(build, D, "launch__shared_mem_per_block_dynamic"), get(build, D, "launch__registers_per_thread"),
                          f"{get(build, D, 'launch__occupancy_limit_registers')} / {get(build, D, 'launch__occupancy_limit_shared_mem')}",
                          get(build, D, "sm__maximum_warps_per_active_cycle_pct"),
                          f"{float(achieved):.1f}" if achieved != "-" else "-"])
    return [f"On the {metrics[-1]['gpu']}: TFLOP/s at S = 4096, non-causal (`{ablations}`); "
            f"resources and occupancy from Nsight Compute (`{profiles}`):", ""] + markdown_table(
        ["build", "D", "TFLOP/s", "shared memory per block (bytes)", "registers per thread",
         "blocks per SM: registers / shared memory", "theoretical occupancy %", "achieved occupancy %"], table,
        ["---", "---:", "---:", "---:", "---:", "---", "---:", "---:"])


def ceilings_table(csv_path):
    """The GPU's measured ceilings (plots/ceilings.py)."""
    path = companion(csv_path, "ceilings")
    rows = read_csv(path)
    if not rows:
        return no_data(path, "H100 ceilings")
    return [f"Measured on the {rows[-1]['gpu']} by `plots/ceilings.py` (commit {rows[-1]['commit']}), from `{path}`:",
            ""] + markdown_table(["ceiling", "value"], [[r["ceiling"], f"{r['value']} {r['unit']}"] for r in rows])


# ---------------------------------------------------------------------------------------------
# The training runs of python/examples/train.py (plots/data/<gpu>_training.csv).

def training_table(csv_path):
    """Per run: the loss at the last logged step, the mean of the last ten logged losses, the first
    logged step below 0.01 nats and the median of the logged throughputs. Then whether each
    flash_stages run's final loss and last-ten mean lie within the range of the SDPA runs (seeds
    apart, the noise), compared at the 5 decimals shown, and its throughput over theirs."""
    path = companion(csv_path, "training")
    rows = read_csv(path)
    if not rows:
        return [f"_No training run committed yet ({path})._"]
    runs = {}
    for r in rows:
        run = runs.setdefault(f"{r['run']} seed {r['seed']}", {"kernel": r["run"], "seed": r["seed"], "losses": [],
                                                               "rates": [], "floor": None})
        run["losses"].append(float(r["loss"]))
        run["last_step"] = int(r["step"])
        if run["floor"] is None and float(r["loss"]) < 0.01:
            run["floor"] = r["step"]
        if r["tokens_per_s"]:
            run["rates"].append(float(r["tokens_per_s"]))
    for run in runs.values():
        run["median"] = statistics.median(run["rates"]) if run["rates"] else 0.0
        run["last"], run["mean"] = f"{run['losses'][-1]:.5f}", f"{sum(run['losses'][-10:]) / 10:.5f}"
    sdpa = [r for r in runs.values() if r["kernel"] == "sdpa_flash"]
    ours = [r for r in runs.values() if r["kernel"] != "sdpa_flash"]

    def described(group):
        seeds = ", ".join(r["seed"] for r in group)
        return f"{len(group)} run{'' if len(group) == 1 else 's'} (seed{' ' if len(group) == 1 else 's '}{seeds})"

    # Runs before the dtype column were fp16, train.py's type then.
    line = (f"One invocation of `python/examples/train.py` on the {rows[-1]['gpu']} in "
            f"{rows[-1].get('dtype') or 'fp16'}, from `{path}`:")
    if sdpa:
        line += f" SDPA flash, {described(sdpa)}"
    if ours:
        line += f"{', and ' if sdpa else ' '}{ours[-1]['kernel']}, {described(ours)}"
    lines = [line + "; runs of one seed start from the same weights and see the same data:", ""] + markdown_table(
        ["run", "loss at the last step", "mean of the last 10 logged losses", "first logged step below 0.01",
         "median tokens/s"],
        [[name, f"{r['last']} (step {r['last_step']})", r["mean"], r["floor"] or "-", f"{r['median']:.0f}"]
         for name, r in runs.items()])
    if not sdpa or not ours:
        return lines

    def verdict(x, values):  # compared as the table shows them
        lo, hi = min(values, key=float), max(values, key=float)
        where = "outside (below)" if float(x) < float(lo) else "outside (above)" if float(x) > float(hi) else "within"
        return f"{x}, {where} the range of the SDPA runs, {lo}..{hi}"

    lines.append("")
    for name, r in runs.items():
        if r["kernel"] == "sdpa_flash":
            continue
        ratios = [r["median"] / s["median"] for s in sdpa]
        speed = f"{min(ratios):.3f}x" if min(ratios) == max(ratios) else f"{min(ratios):.3f}x..{max(ratios):.3f}x"
        lines.append(f"- {name}: loss at the last step {verdict(r['last'], [s['last'] for s in sdpa])}; mean of the "
                     f"last 10 logged losses {verdict(r['mean'], [s['mean'] for s in sdpa])}. Throughput {speed} over "
                     "SDPA flash.")
    return lines


def llama_table(path):
    """python/examples/llama.py's runs: per configuration the median step time with SDPA and with
    flash_stages, SDPA's over flash_stages' (above 1: flash_stages faster), and how far apart the
    two copies' losses came at any step."""
    rows = read_csv(path)
    if not rows:
        return [f"_No Llama run committed yet ({path})._"]
    configs = {}
    for r in rows:
        c = configs.setdefault((int(r["seq"]), int(r["kv_heads"])), {"sdpa": [], "flash_stages": [], "loss": {}})
        if r["step_ms"]:
            c[r["impl"]].append(float(r["step_ms"]))
        c["loss"].setdefault(r["step"], {})[r["impl"]] = float(r["loss"])

    table = []
    for (seq, kv_heads), c in configs.items():
        sdpa, ours = statistics.median(c["sdpa"]), statistics.median(c["flash_stages"])
        gap = max(abs(x["sdpa"] - x["flash_stages"]) for x in c["loss"].values() if len(x) == 2)
        table.append([seq, kv_heads, f"{sdpa:.2f}", f"{ours:.2f}", f"{sdpa / ours:.3f}", f"{gap:.4f}",
                      len(c["sdpa"])])
    first = rows[0]
    stage = next(r["stage"] for r in rows if r["stage"])
    return [f"One invocation of `python/examples/llama.py` on the {first['gpu']}, from `{path}`: a Llama of "
            f"{first['layers']} layers and {first['heads']} heads of D = {first['head_dim']}, batch {first['batch']}, "
            f"in bf16; flash_stages ran {stage}. Step times are medians of the timed steps (forward, backward "
            "and AdamW), the two copies' steps taken in turns:", ""] + markdown_table(
        ["S", "K/V heads", "step, SDPA (ms)", "step, flash_stages (ms)", "SDPA / flash_stages",
         "largest loss difference", "timed steps"], table)


def overhead_table(path):
    """plots/overhead.py's rows: the time per eager step at its small shape, SDPA's, flash_stages'
    through attention() and through the op called directly, and SDPA's over attention()'s."""
    rows = read_csv(path)
    if not rows:
        return [f"_No overhead measurement committed yet ({path})._"]
    us = {(r["impl"], r["causal"], r["pass"]): float(r["us_per_step"]) for r in rows}
    table = []
    for causal in dict.fromkeys(r["causal"] for r in rows):
        for pass_ in ("forward", "forward_backward"):
            sdpa, ours, op = (us[impl, causal, pass_] for impl in ("sdpa", "flash_stages", "flash_stages_op"))
            table.append(["causal" if causal == "1" else "non-causal", pass_.replace("_", " + "), f"{sdpa:.1f}",
                          f"{ours:.1f}", f"{op:.1f}", f"{sdpa / ours:.2f}"])
    r = rows[0]
    return [f"Time per eager step at B={r['batch']} H={r['heads']} S={r['seq']} D={r['dim']} fp16 on the {r['gpu']} "
            f"(`{path}`, plots/overhead.py; flash_stages ran {next(x['stage'] for x in rows if x['stage'])}), in "
            "microseconds: a loop of steps runs as fast as the host enqueues them, so this is host time:", ""] + \
        markdown_table(["mask", "pass", "SDPA", "attention()", "the op alone", "SDPA / attention()"], table)


# ---------------------------------------------------------------------------------------------
# Where the tables go.

def lessons():
    return sorted((ROOT / "stages").glob("*/README.md"))


def report_page(csv_path):
    """Every table of the README and the lessons, from another GPU's CSV, as one page."""
    gpu = read_csv(csv_path)[0]["gpu"]
    lines = [f"# The course on the {gpu}", "",
             f"Generated by `plots/tables.py --report` from `{csv_path}`: the tables of the",
             "[course README](../README.md) and of each lesson, from this GPU's own run of the benchmark",
             "(`cmake --workflow --preset bench`, or its parts: `plots/bench.sh`). The lessons' prose",
             "discusses the H100's numbers, and their ladder tables the H200's.", "",
             "## All stages", ""] + course_table(csv_path)
    if (ROOT / companion(csv_path, "profiles")).exists() and (ROOT / companion(csv_path, "ceilings")).exists():
        lines += [""] + roofline_table(csv_path)
    for lesson in lessons():
        stage = lesson.parent.name
        lines += ["", f"## [{stage}](../{lesson.relative_to(ROOT)})", ""] + stage_table(csv_path, stage, "fwd")
        if f"<!-- measured:{stage}:bwd:begin -->" in lesson.read_text():
            lines += [""] + stage_table(csv_path, stage, "bwd")
        ablations = ablation_table(csv_path, stage)
        if ablations and (ROOT / companion(csv_path, "ablations")).exists():
            lines += [""] + ablations
        if (ROOT / companion(csv_path, "ladders")).exists():
            for direction in ("fwd", "bwd"):
                ladder = ladder_table(csv_path, stage, direction, f"plots/{pathlib.Path(csv_path).stem}.md")
                if ladder:
                    lines += [""] + ladder
        bf16 = bf16_table(csv_path, stage)
        if bf16:
            lines += [""] + bf16
        if (ROOT / companion(csv_path, "profiles")).exists():
            lines += [""] + profile_table(csv_path, stage)
    return "\n".join(lines) + "\n"


def blocks():
    """(file, key, table lines) of every table of the README, docs and lessons (the H100's)."""
    yield "README.md", "course", course_table(H100)
    yield "docs/h100.md", "ceilings", ceilings_table(H100)
    yield "stages/04_smem_state/README.md", "04_smem_state:occupancy", occupancy_table(H100)
    yield ("stages/07_swizzle_cp_async/README.md", "07_swizzle_cp_async:vs_flash",
           ratio_table(H100, "07_swizzle_cp_async", "sdpa_flash"))
    yield ("stages/10_fa3_schedule/README.md", "10_fa3_schedule:vs_cudnn",
           ratio_table(H100, "10_fa3_schedule", "sdpa_cudnn", "fwd", 1024))
    yield ("stages/10_fa3_schedule/README.md", "10_fa3_schedule:bwd_vs_cudnn",
           ratio_table(H100, "10_fa3_schedule", "sdpa_cudnn", "bwd", 2048))
    yield ("stages/08_warp_specialized/README.md", "08_warp_specialized:vs_flash_h200",
           peer_profile_table(H200, "08_warp_specialized:warp_specialized_forward", "sdpa_flash:flash_fwd_kernel",
                              "08_warp_specialized:backward_dk_dv", "sdpa_flash:flash_bwd_dq_dk_dv", dims=(128,)))
    yield ("stages/08_warp_specialized/README.md", "08_warp_specialized:vs_flash_profile_h200",
           peer_profile_table(H200, "08_warp_specialized:backward_dk_dv", "sdpa_flash:flash_bwd_dq_dk_dv"))
    yield ("stages/08_warp_specialized/README.md", "08_warp_specialized:vs_flash_profile",
           peer_profile_table(H100, "08_warp_specialized:backward_dk_dv", "sdpa_flash:flash_bwd_dq_dk_dv"))
    yield ("stages/10_fa3_schedule/README.md", "10_fa3_schedule:vs_cudnn_profile",
           peer_profile_table(H100, "10_fa3_schedule:backward_dk_dv", "10_fa3_schedule.deterministic_dq:backward_dk_dv",
                              "10_fa3_schedule.deterministic_dq:backward_dq", "sdpa_cudnn:flash_bprop"))
    yield "stages/11_fp8/README.md", "11_fp8:vs_stage10", ratio_table(H200, "11_fp8", "10_fa3_schedule")
    yield "stages/11_fp8/README.md", "11_fp8:vs_cudnn_fp8", ratio_table(H200, "11_fp8", "cudnn_fp8")
    yield "stages/11_fp8/README.md", "11_fp8:cudnn_fp8_vs_stage10", ratio_table(H200, "cudnn_fp8", "10_fa3_schedule")
    yield "stages/11_fp8/README.md", "11_fp8:accuracy", fp8_accuracy_table(FP8_ACCURACY)
    yield "README.md", "roofline", roofline_table(H100)
    yield "README.md", "bf16", bf16_summary(H200)
    yield "README.md", "training", training_table(H200)
    yield "python/README.md", "training", training_table(H200)
    yield "python/README.md", "llama", llama_table("plots/data/h200_llama.csv")
    yield "python/README.md", "overhead", overhead_table("plots/data/h200_overhead.csv")
    yield "README.md", "llama", llama_table("plots/data/h200_llama.csv")
    for lesson in lessons():
        stage, path = lesson.parent.name, str(lesson.relative_to(ROOT))
        yield path, stage, stage_table(lesson_gpu(stage), stage, "fwd")
        yield path, f"{stage}:bwd", stage_table(lesson_gpu(stage), stage, "bwd")
        yield path, f"{stage}:ablations", ablation_table(ablations_gpu(stage), stage) or []
        yield path, f"{stage}:profile", profile_table(H100, stage)
        yield path, f"{stage}:ladder", ladder_table(H200, stage, "fwd") or []
        yield path, f"{stage}:ladder_bwd", ladder_table(H200, stage, "bwd") or []


def with_block(text, key, lines):
    """text with the lines between KEY's markers replaced by `lines`; text itself without them."""
    begin, end = f"<!-- measured:{key}:begin -->", f"<!-- measured:{key}:end -->"
    if begin not in text:
        return text
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + begin + "\n" + "\n".join(lines) + "\n" + end + tail


def bench_csvs():
    """The benchmark's CSVs, plots/data/<gpu>.csv, without the others that share the folder."""
    return sorted(f"plots/data/{p.name}" for p in (ROOT / "plots" / "data").glob("*.csv")
                  if not re.search(r"_(ceilings|ablations|ladders|bf16|profiles|training|overhead|llama|fp8_accuracy)\.csv$", p.name))


def main(argv):
    mode = argv[1] if len(argv) > 1 else ""
    if mode == "--report" and len(argv) == 4:
        pathlib.Path(argv[3]).write_text(report_page(argv[2]))
        return 0
    if mode == "--roofline" and len(argv) == 3:
        for point in roofline_points(argv[2]):
            print(" ".join(str(x) for x in point))
        return 0
    if mode == "--fp8-accuracy" and len(argv) == 3:
        for label, normal, outliers in fp8_accuracy_points(argv[2]):
            print(f'"{label}" {normal} {outliers}')
        return 0
    if mode not in ("--update", "--check"):
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    texts, status = {}, 0
    for lesson_path, key, lines in blocks():
        # A lesson's table may live in its notes (stages/<stage>/notes.md) instead.
        notes = str(pathlib.Path(lesson_path).with_name("notes.md"))
        for path in [lesson_path] + ([notes] if lesson_path.endswith("README.md") and (ROOT / notes).exists() else []):
            if path not in texts:
                texts[path] = (ROOT / path).read_text()
            texts[path] = with_block(texts[path], key, lines)
    for data in bench_csvs():
        texts[f"plots/{pathlib.Path(data).stem}.md"] = report_page(data)
    for path, text in texts.items():
        if mode == "--update":
            (ROOT / path).write_text(text)
        elif not (ROOT / path).exists() or (ROOT / path).read_text() != text:
            print(f"tables: the measured tables of {path} differ from the CSVs; run python3 plots/tables.py --update",
                  file=sys.stderr)
            status = 1
    if mode == "--check" and status == 0:
        print("tables: README, lesson tables and report pages match plots/data")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
