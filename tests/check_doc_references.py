#!/usr/bin/env python3
"""check_doc_references.py - every reference the course's prose makes must exist.

For each tracked Markdown file:
  - relative links [text](path#anchor): the file exists, and the anchor is a heading of it;
  - repository paths in code spans (`stages/08_warp_specialized/backward.cu`): the file or
    directory exists (paths under build/ are build outputs and are not checked);
  - commits ("commit 4e120ef", "at 1d11bc4"): the commit is in the history (skipped, with a note,
    in a shallow clone that lacks the history);
  - compile-time knobs (`-DATOMIC_DQ=0`): some source under stages/ or common/ tests the macro;
  - options of the stage programs (`build/bin/08_warp_specialized --backward`): the harness
    parses them; an ablation build (`build/bin/07_swizzle_cp_async.no_swizzle`) is listed in its
    stage's ablations.txt;
  - measured values in prose (a number with a decimal point followed by TFLOP/s, us, µs, ms or
    GB/s, alone or closing a list "a / b / c TFLOP/s"), outside the generated tables: the number
    appears in a committed measurement (plots/data/*.csv, at its precision; docs/profiles/*.txt) or
    in a generated table, so no hand-typed or stale timing survives a new run.
Prints each broken reference as FILE:LINE: what, and exits 1 if there is any.
"""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def git(*args):
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def tracked_markdown():
    out = git("ls-files", "*.md")
    if out.returncode != 0:  # not a git checkout: every Markdown file outside build trees
        return sorted(p for p in ROOT.rglob("*.md") if "build" not in p.relative_to(ROOT).parts)
    return [ROOT / line for line in out.stdout.split() if line]


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", path.read_text(), re.M)}


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`\n]+)`")
COMMIT = re.compile(r"\b(?:commits?|at|from|in)\s+([0-9a-f]{7,40})\b")
KNOB = re.compile(r"-D([A-Z][A-Z0-9_]+)=")
PATH = re.compile(r"^(?:stages|common|tests|plots|docs|python|\.ci)/[\w./-]+$")
PROGRAM = re.compile(r"build/bin/(\d\d_\w+)(?:\.(\w+))?((?:\s+[^`|]*)?)")
# A measured value, or a list of them sharing one unit: "253.3 TFLOP/s", "7.65 / 7.31 ms".
MEASURED = re.compile(r"((?:\d[\d,]*\.\d+\s*/\s*)*\d[\d,]*\.\d+)\s*(?:TFLOP/s|µs|us\b|ms\b|GB/s)")
BLOCK = re.compile(r"<!-- measured:([^ ]+):begin -->(.*?)<!-- measured:\1:end -->", re.S)
NUMBER = re.compile(r"-?\d[\d,]*\.?\d*(?:e[-+]?\d+)?")


def measured_evidence():
    """Every number a committed measurement or generated table holds, as written and, for the
    CSVs, rounded to 0-3 decimals, also divided by 1000 (prose quotes a CSV value at the precision
    a table shows, a time in us also in ms)."""
    values = set()
    for path in ROOT.glob("plots/data/*.csv"):
        for line in path.read_text().splitlines()[1:]:
            for cell in line.split(","):
                try:
                    x = float(cell)
                except ValueError:
                    continue
                values.add(cell)
                values.update(f"{x:.{d}f}" for d in range(4))
                values.update(f"{x / 1000:.{d}f}" for d in range(4))  # us as ms, GB/s as TB/s
    for path in ROOT.glob("docs/profiles/*.txt"):
        values.update(n.replace(",", "") for n in NUMBER.findall(path.read_text()))
    for md in tracked_markdown():
        for _, body in BLOCK.findall(md.read_text()):
            values.update(n.replace(",", "") for n in NUMBER.findall(body))
    return values


def source_macros():
    """Every macro a kernel or helper source tests with #ifndef, #ifdef or defined()."""
    macros = set()
    for pattern in ("stages/*/*", "common/*"):
        for path in ROOT.glob(pattern):
            if path.suffix in (".cu", ".cuh", ".h", ".c"):
                for ifdef, defined in re.findall(r"#\s*(?:ifndef|ifdef)\s+(\w+)|defined\((\w+)\)", path.read_text()):
                    macros.add(ifdef or defined)
    return macros


def harness_options():
    return set(re.findall(r'"(--[a-z][a-z0-9-]*)"', (ROOT / "common" / "harness.c").read_text()))


def main():
    problems = []
    shallow = git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    have_git = git("rev-parse", "HEAD").returncode == 0
    commits_known = {}
    macros, options = source_macros(), harness_options()
    evidence = measured_evidence()
    anchor_cache = {}
    checked = dict.fromkeys(("links", "paths", "commits", "knobs", "options", "measured values"), 0)
    for md in tracked_markdown():
        rel = md.relative_to(ROOT)
        text = md.read_text()
        in_fence = in_block = False
        for number, line in enumerate(text.splitlines(), 1):
            where = f"{rel}:{number}"
            if line.lstrip().startswith("```"):
                in_fence = not in_fence
            if re.match(r"<!-- measured:\S+:begin -->", line):
                in_block = True
            elif re.match(r"<!-- measured:\S+:end -->", line):
                in_block = False
            if not in_fence and not in_block and not rel.parts[0] == "plots":
                for group in MEASURED.findall(line):
                    for value in re.split(r"\s*/\s*", group):
                        checked["measured values"] += 1
                        if value.replace(",", "") not in evidence:
                            problems.append(f"{where}: {value}: no committed measurement or generated table holds this value")
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target):
                    continue  # http(s), mailto
                checked["links"] += 1
                file_part, _, anchor = target.partition("#")
                dest = (md.parent / file_part).resolve() if file_part else md
                if file_part and not dest.exists():
                    problems.append(f"{where}: link to {target}: no such file")
                    continue
                if anchor and dest.suffix == ".md":
                    if dest not in anchor_cache:
                        anchor_cache[dest] = anchors(dest)
                    if anchor not in anchor_cache[dest]:
                        problems.append(f"{where}: link to {target}: no heading with that anchor")
            spans = SPAN.findall(line) if not in_fence else [line]
            for span in spans:
                for word in span.split():
                    word = word.strip(".,;:()")
                    template = "<" in word or "NN" in word  # stages/NN_name/, libflash_stages_<stage>.so
                    if PATH.match(word) and not template:
                        checked["paths"] += 1
                    if PATH.match(word) and not template and not (ROOT / word).exists():
                        problems.append(f"{where}: {word}: no such file or directory")
                for knob in KNOB.findall(span):
                    checked["knobs"] += 1
                    if knob not in macros and not knob.startswith("CMAKE_"):  # CMake's own variables
                        problems.append(f"{where}: -D{knob}: no source under stages/ or common/ tests it")
                for match in PROGRAM.finditer(span):
                    stage, ablation = match.group(1), match.group(2)
                    listed = ROOT / "stages" / stage / "ablations.txt"
                    if ablation and not (listed.exists() and re.search(rf"^\s*{ablation}\s*\|", listed.read_text(), re.M)):
                        problems.append(f"{where}: build/bin/{stage}.{ablation}: not an ablation build of {stage}")
                    for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", match.group(3)):
                        checked["options"] += 1
                        if option not in options:
                            problems.append(f"{where}: {option}: not an option of the stage programs")
            for sha in COMMIT.findall(line):
                if not have_git or shallow:
                    continue
                checked["commits"] += 1
                if sha not in commits_known:
                    commits_known[sha] = git("cat-file", "-e", f"{sha}^{{commit}}").returncode == 0
                if not commits_known[sha]:
                    problems.append(f"{where}: commit {sha} is not in the history")
    if shallow or not have_git:
        print("check_doc_references: no full git history here; commits not checked")
    for problem in problems:
        print(problem)
    print("check_doc_references: checked " + ", ".join(f"{n} {kind}" for kind, n in checked.items()) +
          f"; {len(problems)} broken")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
