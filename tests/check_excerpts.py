#!/usr/bin/env python3
"""check_excerpts.py - every code excerpt in the lessons is a piece of the source it names.

An excerpt is a fenced code block whose opening fence comes right after a line

    <!-- excerpt: stages/01_naive_3pass/naive_3pass.cu -->

(a path from the repository's root). The block must be 10 to 30 lines, and those lines must be
consecutive lines of that file, character for character once the common indentation of both is
removed: a lesson never shows code that the course does not run. Before checking, the script
changes one character of the first excerpt it finds and makes sure that the copy fails, so
that the check itself is tested. Exit status 1 if an excerpt is missing from its source.
"""
import pathlib
import re
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- excerpt: (\S+) -->$")
MIN_LINES, MAX_LINES = 10, 30


def excerpts(text):
    """(line number of the marker, path, the block's lines) of each excerpt of a Markdown text."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = MARKER.match(line.strip())
        if not match or i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            continue
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), len(lines))
        yield i + 1, match.group(1), lines[i + 2:end]


def normalized(lines):
    return textwrap.dedent("\n".join(line.rstrip() for line in lines)).splitlines()


def found_in(block, source_lines):
    """Whether the block's lines are consecutive lines of the source, indentation aside."""
    want, n = normalized(block), len(block)
    return any(normalized(source_lines[start:start + n]) == want for start in range(len(source_lines) - n + 1))


def problems(markdown, text):
    """What is wrong with the excerpts of one Markdown text, one line each."""
    out = []
    for number, path, block in excerpts(text):
        where = f"{markdown}:{number}"
        source = ROOT / path
        if not source.is_file():
            out.append(f"{where}: {path}: no such file")
        elif not MIN_LINES <= len(block) <= MAX_LINES:
            out.append(f"{where}: {len(block)} lines; an excerpt has {MIN_LINES} to {MAX_LINES}")
        elif not found_in(block, source.read_text().splitlines()):
            out.append(f"{where}: the excerpt is not a run of lines of {path} (edited here or there?)")
    return out


def lessons():
    return sorted(ROOT.glob("stages/*/README.md")) + sorted(ROOT.glob("docs/*.md")) + [ROOT / "README.md"]


def main():
    texts = {path.relative_to(ROOT): path.read_text() for path in lessons()}
    found = [(md, text) for md, text in texts.items() for _ in excerpts(text)]
    if not found:
        print("check_excerpts: no excerpts found", file=sys.stderr)
        return 1
    # The check must catch an edit: change one character of the first excerpt's code.
    md, text = found[0]
    number, _, _ = next(excerpts(text))
    lines = text.splitlines()
    first_code = number + 1  # 0-based index of the block's first line
    lines[first_code] = lines[first_code] + " /* edited */"
    if not problems(md, "\n".join(lines)):
        print(f"check_excerpts: an edited copy of {md}:{number} was not caught", file=sys.stderr)
        return 1
    failures = [p for md, text in texts.items() for p in problems(md, text)]
    for failure in failures:
        print(failure, file=sys.stderr)
    count = sum(1 for text in texts.values() for _ in excerpts(text))
    print(f"check_excerpts: {count} excerpts in {len({md for md, _ in found})} files; {len(failures)} not in their source")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
