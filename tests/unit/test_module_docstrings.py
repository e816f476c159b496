"""Every rl_core module starts with a short docstring, and no docstring or comment carries history.

- A module's first statement is its docstring, at most 15 source lines (quotes included): what
  it owns, what it does not own, where to read more (house rules).
- No docstring (module, class, function, or the string after a field) and no comment holds a
  date (YYYY-MM-DD) or names an H100 / H200: measurements live in docs/benchmarks.md.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_DOCSTRING_LINES = 15
HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bH[12]00\b")


def docstring_lines(source: str) -> int | None:
    """Source lines of the module docstring's literal, None when the module has none."""
    body = ast.parse(source).body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return None


def history_mentions(source: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring line and comment holding a date or an H100 / H200."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for i, line in enumerate(node.value.value.splitlines()):
                if HISTORY.search(line):
                    found.append((node.lineno + i, line.strip()))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and HISTORY.search(tok.string):
            found.append((tok.start[0], tok.string.strip()))
    return sorted(found)


def modules() -> list[Path]:
    return sorted((ROOT / "rl_core").rglob("*.py"))


def test_the_checks_catch_what_they_pin():
    long_doc = '"""' + "\n".join(f"line {i}" for i in range(15)) + '\n"""\nx = 1\n'
    assert docstring_lines(long_doc) == 16 and docstring_lines('"""one line."""\n') == 1
    assert docstring_lines("import os\n") is None
    planted = ('"""Fine."""\n# measured 2026-12-05\nclass A:\n    """On an H200 it took 3 ms."""\n'
               '    size: int = 1\n    """A field, measured on the H100."""\n    name = "H200"  # a value, not prose\n')
    assert [line for line, _ in history_mentions(planted)] == [2, 4, 6]


def test_every_module_docstring_is_at_most_15_lines():
    assert len(modules()) > 100
    missing = [str(p.relative_to(ROOT)) for p in modules() if docstring_lines(p.read_text()) is None]
    long = {str(p.relative_to(ROOT)): n for p in modules()
            if (n := docstring_lines(p.read_text())) is not None and n > MAX_DOCSTRING_LINES}
    assert not missing, f"modules without a docstring: {missing}"
    assert not long, (f"module docstrings over {MAX_DOCSTRING_LINES} lines (keep owns / does not own / read more; "
                      f"move detail into docs/ or the function it describes): {long}")


def test_no_dates_or_gpu_timings_in_docstrings_or_comments():
    found = {f"{p.relative_to(ROOT)}:{line}": text for p in modules() for line, text in history_mentions(p.read_text())}
    assert not found, f"dates or H100/H200 figures in rl_core's prose (move them to docs/benchmarks.md): {found}"
