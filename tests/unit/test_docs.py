"""The docs stay a front door: a short README, every link resolving, history kept out of the pages.

- README.md is at most 150 lines and starts with the two commands (`make run`, `make test`).
- Every relative link in README.md and docs/*.md names a file that exists and, with `#anchor`,
  a heading of that file (GitHub's anchor rule: lower case, punctuation dropped, spaces -> `-`).
- docs/benchmarks.md holds the one table of measured figures (figure, value, hardware, date,
  commit, command); every other page is at most 20% history by `history_share` below.
- Every `docs/page.md, "Section"` that code, tests or benches cite names a heading of that page.

`history_share` is deliberately simple. Blocks are runs of non-blank lines (a table, and each list
item, is a block of its own). A table row counts as history when it holds a date (2026-12-05), a GPU name
(H100, H200, A100), "measured", "N-th round", or a measured figure (a number with a unit of
time or throughput, a ratio such as 1.5x, a percentage); a prose block counts whole when one
of its lines holds a date, a GPU name, "measured" or a round, or when a third of its lines
hold a measured figure. Run this file as a script to print each page's share.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
MAX_README_LINES = 150
MAX_HISTORY = 0.20

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
             "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth")
DATED = re.compile(rf"\b20\d\d-\d\d(?:-\d\d)?\b|\b[HA]1[02]0\b|\b[Mm]easured\b|\b(?:{_ORDINALS}) round\b", re.I)
FIGURE = re.compile(r"\d(?:[\d,]*\d)?(?:\.\d+)?\s?(?:ms|us|µs|ns|s|min|tok/s|tokens/s|TFLOP/s|TB/s|GB/s)\b"
                    r"|(?<![\w.])\d+(?:\.\d+)?x\b|\d%")
ITEM = re.compile(r"(?:[-*]|\d+\.) ")  # a list item starts a block of its own
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _blocks(text: str) -> list[list[str]]:
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if not line.strip():
            blocks.append([])
        elif blocks and blocks[-1] and blocks[-1][0].startswith("|") == line.startswith("|") and not ITEM.match(line):
            blocks[-1].append(line)
        else:
            blocks.append([line])
    return [b for b in blocks if b]


def history_share(text: str) -> tuple[int, int]:
    """(history lines, non-blank lines) of a markdown page, by the rule of the module docstring."""
    total = history = 0
    for block in _blocks(text):
        total += len(block)
        if block[0].startswith("|"):
            history += sum(1 for line in block if DATED.search(line) or FIGURE.search(line))
        elif any(DATED.search(line) for line in block) or 3 * sum(bool(FIGURE.search(line)) for line in block) >= len(block):
            history += len(block)
    return history, total


def anchors(path: Path) -> set[str]:
    found, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", title)))
    return found


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def broken_links(path: Path) -> list[str]:
    bad = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target} (no file {_shown(dest)})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {_shown(dest)})")
    return bad


def test_history_share_counts_dated_and_measured_blocks_and_not_plain_prose():
    assert history_share("A knob: `max_tokens`, the most new tokens.\nIt is checked at load.\n") == (0, 2)
    assert history_share("Measured on 2026-12-05:\nthe step got faster.\n") == (2, 2)
    assert history_share("| a | b |\n|---|---|\n| step | 1.16 ms |\n| knob | `x` |\n") == (1, 4)
    assert history_share("The sixteenth round found\nsomething.\n\nplain\n") == (2, 3)
    assert history_share("- a knob\n  its meaning\n- measured: 2 ms\n") == (1, 3)


def test_anchor_rule_matches_github_headings(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# The vLLM backends (`generation.backend: vllm`)\n```\n# not a heading\n```\n## rl-core serve: over HTTP\n")
    assert anchors(page) == {"the-vllm-backends-generationbackend-vllm", "rl-core-serve-over-http"}
    (tmp_path / "q.md").write_text("[a](p.md#rl-core-serve-over-http) [b](p.md#nope) [c](missing.md) [d](https://x.org)\n")
    assert [b.split(" ")[0] for b in broken_links(tmp_path / "q.md")] == ["p.md#nope", "missing.md"]


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/ (<= {MAX_README_LINES})"
    commands = [line.split("#")[0].strip() for line in lines[:8] if line.startswith("make ")]
    assert commands == ["make run", "make test"], commands


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(path):
    assert not broken_links(path), f"{path.relative_to(ROOT)}: broken links {broken_links(path)}"


def test_benchmarks_page_is_one_table_with_the_columns():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    header = "| figure | value | hardware | date | commit | command |"
    assert text.count(header) == 1, f"docs/benchmarks.md needs exactly one table headed {header!r}"
    rows = [line for line in text.split(header, 1)[1].splitlines()[1:] if line.startswith("|")]
    assert len(rows) >= 20 and all(line.count("|") - line.count("\\|") == 7 for line in rows)


SECTION_REF = re.compile(r'docs/([a-z-]+\.md)[,:]?\s+"([^"]+)"')


def section_refs(text: str) -> list[tuple[str, str]]:
    """(page, section) of every `docs/page.md, "Section"` in code or tests (wrapped lines joined)."""
    return SECTION_REF.findall(re.sub(r"\s*\n\s*(?:#\s*)?", " ", text))


def test_section_references_in_code_and_tests_name_a_heading():
    assert section_refs('see docs/generation.md, "The vLLM\n    backends" and') == [("generation.md", "The vLLM backends")]
    headings = {p.name: [h.lower() for h in re.findall(r"^#+ (.*)$", p.read_text(), re.M)] for p in DOCS}
    bad = []
    for path in sorted((ROOT / "rl_core").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "bench").glob("*.py")):
        if path == Path(__file__).resolve():
            continue  # this file's own examples
        for page, section in section_refs(path.read_text()):
            if not any(section.lower() in h for h in headings.get(page, [])):
                bad.append(f"{path.relative_to(ROOT)}: docs/{page} \"{section}\"")
    assert not bad, f"references to a docs section that no heading carries: {bad}"


@pytest.mark.parametrize("path", [p for p in DOCS if p.name not in ("benchmarks.md",)], ids=lambda p: p.name)
def test_history_is_at_most_a_fifth_of_each_page(path):
    history, total = history_share(path.read_text())
    assert history <= MAX_HISTORY * total, (
        f"{path.relative_to(ROOT)}: {history} of {total} lines are measurement history ({history / total:.0%}); "
        f"condense it to what was learned and move the figures to docs/benchmarks.md")


if __name__ == "__main__":
    for page in DOCS:
        h, t = history_share(page.read_text())
        print(f"{str(page.relative_to(ROOT)):32} {len(page.read_text().splitlines()):5} lines  "
              f"{h:5} / {t:5} history  {100 * h / max(t, 1):5.1f}%", file=sys.stdout)
