#!/usr/bin/env python3
"""check_doc_references.py - every reference the course's prose makes must exist.

For each tracked code file, the repository paths its comments name exist. For each tracked
Markdown file:
  - relative links [text](path#anchor): the file exists, and the anchor is a heading of it;
  - repository paths in code spans (`stages/08_warp_specialized/backward.cu`): the file or
    directory exists (paths under build/ are build outputs and are not checked);
  - commits ("commit 4e120ef", "at 1d11bc4"): the commit is in the history (skipped, with a note,
    in a shallow clone that lacks the history);
  - compile-time knobs (`-DATOMIC_DQ=0`): some source under stages/ or common/ tests the macro;
  - options of the stage programs (`build/bin/08_warp_specialized --backward`): the harness
    parses them; an ablation build (`build/bin/07_swizzle_cp_async.no_swizzle`) is listed in its
    stage's ablations.txt;
  - numbers in prose: every number with a decimal point outside code, links and the generated
    tables is either in a committed measurement (plots/data/*.csv at the precision written, also
    divided by 1e3 or 1e6 for us -> ms -> s; docs/profiles/*.txt) or in a generated table, or is
    computed by one division, product, sum, difference or percentage from numbers of its own
    paragraph (which may themselves be computed so): no hand-typed or stale number survives a
    new run, and every derived one shows what it comes from.
Prints each broken reference as FILE:LINE: what, and exits 1 if there is any.
"""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]



def is_ladder_step(stage, build):
    """Whether `build` names a step of the stage's ladder (stages/<stage>/ladder.txt): <pass>_step<k>
    with k below the number of that pass's ideas, or <pass>_step followed by a placeholder."""
    match = re.fullmatch(r"(fwd|bwd)_step(\d*)", build)
    ladder = ROOT / "stages" / stage / "ladder.txt"
    if not match or not ladder.exists():
        return False
    ideas = sum(1 for line in ladder.read_text().splitlines()
                if line.strip() and not line.startswith("#") and line.split("|")[1].strip() == match.group(1))
    return match.group(2) == "" or int(match.group(2)) < ideas

def git(*args):
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def tracked_markdown():
    out = git("ls-files", "*.md")
    if out.returncode != 0:  # not a git checkout: every Markdown file outside build trees
        return sorted(p for p in ROOT.rglob("*.md") if "build" not in p.relative_to(ROOT).parts)
    return [ROOT / line for line in out.stdout.split() if line and (ROOT / line).exists()]  # deleted, not yet committed


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
DECIMAL = re.compile(r"(?<![\w.])\d[\d,]*\.\d+(?![\w.])")
ANY_NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?![\w.])")
BLOCK = re.compile(r"<!-- measured:([^ ]+):begin -->(.*?)<!-- measured:\1:end -->", re.S)
NUMBER = re.compile(r"-?\d[\d,]*\.?\d*(?:e[-+]?\d+)?")


def rounded(x, scales=(1,)):
    """x (and x / scale) as prose may write it: 0-3 decimals."""
    return {f"{x / scale:.{d}f}" for scale in scales for d in range(4)}


def mentioned_stages(text):
    """The stage numbers ("01".."99") a page names: "stage 03", "stages 05-07", 03_online_softmax;
    a lesson names its own stage by its directory."""
    number = r"(0[1-9]|[1-9]\d)"
    found = set(re.findall(rf"\b{number}_[a-z]", text))
    for first, last in re.findall(rf"[Ss]tages? {number}(?:\s*(?:-|–|to|and)\s*{number})?", text):
        found.update(f"{n:02d}" for n in range(int(first), int(last or first) + 1))
    return found


def measured_evidence(stages):
    """Every number the committed measurements hold for the given stages (and the PyTorch peers,
    the ceilings and the training run), as prose may write it, and every number of the generated
    tables of README.md and of those stages' lessons. Times in us also count in ms and s, bytes
    also in GB and MB."""
    values = set()
    for path in ROOT.glob("plots/data/*.csv"):
        lines = path.read_text().splitlines()
        header = lines[0].split(",")
        for line in lines[1:]:
            row = dict(zip(header, line.split(",")))
            name = row.get("stage", row.get("build", ""))
            if name[:2].isdigit() and name[:2] not in stages:
                continue
            for column, cell in row.items():
                try:
                    x = float(cell)
                except ValueError:
                    continue
                values.add(cell)
                us = (1, 1e3, 1e6)
                scales = {"median_us": us, "min_us": us, "max_us": us, "gbps": (1, 1e3)}.get(column, (1,))
                if column == "value":  # a profile metric: bytes, nanoseconds, counts
                    scales = (1, 1e3, 1e6, 1e9)
                values |= rounded(x, scales)
    for path in ROOT.glob("docs/profiles/*.txt"):
        if path.name[:2] in stages:
            values.update(n.replace(",", "") for n in NUMBER.findall(path.read_text()))
    pages = [ROOT / "README.md"] + [p for p in ROOT.glob("stages/*/README.md") if p.parent.name[:2] in stages]
    for md in pages:
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


def prose(line):
    """A line without its code spans and link targets, where numbers are not prose."""
    return re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "", line))


def derived(numbers, written):
    """Which written numbers are one a/b, a*b, a+b, a-b or percentage of two other numbers of the
    paragraph (a number computed so may in turn feed another), rounded as the prose writes it."""
    pool = [float(n) for n in numbers]
    found = set()
    for _ in range(2):
        for text in sorted(written - found):
            x, d = float(text), len(text.split(".")[1])
            others = [v for v in pool if v != x] + [float(t) for t in found if t != text]
            # within one unit of the last digit written: a ratio of rounded ratios may differ so
            if any(abs(r - x) <= 1.01 * 10 ** -d for a in others for b in others if a != b
                   for r in ([a * b, a + b, a - b] + ([a / b, 100 * a / b, 100 * (a / b - 1), 100 * (1 - a / b)] if b else []))):
                found.add(text)
    return found


def unexplained_numbers(md, evidence):
    """(line, number) for every decimal number of md's prose that is neither evidence nor derived."""
    paragraphs, current, in_fence, in_block = [], [], False, False
    for number, line in enumerate(md.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if re.match(r"<!-- measured:\S+:begin -->", line):
            in_block = True
        if re.match(r"<!-- measured:\S+:end -->", line):
            in_block = False
            continue
        if in_fence or in_block or not line.strip():
            if current:
                paragraphs.append(current)
            current = []
            continue
        current.append((number, prose(line)))
    if current:
        paragraphs.append(current)
    for paragraph in paragraphs:
        written = {n.replace(",", "") for _, text in paragraph for n in DECIMAL.findall(text)} - evidence
        if not written:
            continue
        numbers = [n.replace(",", "") for _, text in paragraph for n in ANY_NUMBER.findall(text)]
        explained = derived(numbers, written)
        for number, text in paragraph:
            for n in DECIMAL.findall(text):
                if n.replace(",", "") in written - explained:
                    yield number, n


def tracked_sources():
    """The tracked code files whose comments may name repository paths."""
    out = git("ls-files", "*.cu", "*.cuh", "*.c", "*.h", "*.sh", "*.py", "*.awk", "*.gp", "*.cmake",
              "CMakeLists.txt", ".ci/run")
    return [ROOT / line for line in out.stdout.split() if line and (ROOT / line).exists()] if out.returncode == 0 else []


def comment_text(path, line):
    """The comment part of one line of code: after // in C and CUDA, after # elsewhere."""
    marker = "//" if path.suffix in (".cu", ".cuh", ".c", ".h") else "#"
    return line.split(marker, 1)[1] if marker in line else ""


def harness_options():
    return set(re.findall(r'"(--[a-z][a-z0-9-]*)"', (ROOT / "common" / "harness.c").read_text()))


def main():
    problems = []
    shallow = git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    have_git = git("rev-parse", "HEAD").returncode == 0
    commits_known = {}
    macros, options = source_macros(), harness_options()
    evidence_cache = {}
    anchor_cache = {}
    checked = dict.fromkeys(("links", "paths", "commits", "knobs", "options", "prose numbers"), 0)
    for md in tracked_markdown():
        rel = md.relative_to(ROOT)
        text = md.read_text()
        if rel.parts[0] != "plots":  # plots/<gpu>.md is generated whole
            stages = frozenset(mentioned_stages(text) | ({rel.parts[1][:2]} if rel.parts[0] == "stages" else set()))
            if stages not in evidence_cache:
                evidence_cache[stages] = measured_evidence(stages)
            evidence = evidence_cache[stages]
            checked["prose numbers"] += sum(len(DECIMAL.findall(prose(l))) for l in text.splitlines())
            for number, value in unexplained_numbers(md, evidence):
                problems.append(f"{rel}:{number}: {value}: neither in a committed measurement or generated "
                                "table nor computed from numbers of its paragraph")
        in_fence = False
        for number, line in enumerate(text.splitlines(), 1):
            where = f"{rel}:{number}"
            if line.lstrip().startswith("```"):
                in_fence = not in_fence
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
                    if ablation and not (listed.exists() and re.search(rf"^\s*{ablation}\s*\|", listed.read_text(), re.M)
                                         or is_ladder_step(stage, ablation)):
                        problems.append(f"{where}: build/bin/{stage}.{ablation}: not an ablation build or ladder step of {stage}")
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
    # Code comments: the repository paths they name exist.
    for source in tracked_sources():
        for number, line in enumerate(source.read_text().splitlines(), 1):
            for word in comment_text(source, line).split():
                word = word.strip(".,;:()`'\"")
                if PATH.match(word) and not any(t in word for t in ("<", "NN", "*")):  # not a template
                    checked["paths"] += 1
                    if not (ROOT / word).exists():
                        problems.append(f"{source.relative_to(ROOT)}:{number}: {word}: no such file or directory")
    if shallow or not have_git:
        print("check_doc_references: no full git history here; commits not checked")
    for problem in problems:
        print(problem)
    print("check_doc_references: checked " + ", ".join(f"{n} {kind}" for kind, n in checked.items()) +
          f"; {len(problems)} broken")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
