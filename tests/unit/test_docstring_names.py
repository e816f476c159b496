"""Every dotted `rl_core.*` name the prose mentions resolves to something that exists.

Scanned: the docstrings of every module, class and function under rl_core/, and the
backticked spans of docs/*.md and README.md. A name resolves when its longest importable
prefix is a module and the rest are attributes of it (`rl_core.launch.preflight.preflight`);
`rl_core.x.y:Name` (the import-path form of plug-ins) also needs `Name` in the module. A
name directly followed by `/` is a format tag (`rl_core.rollouts/1`), not a Python name.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\brl_core(?:\.[A-Za-z_][A-Za-z0-9_]*)+(?::[A-Za-z_][A-Za-z0-9_]*)?")


def _names(text: str) -> set[str]:
    return {m.group(0) for m in NAME.finditer(text) if text[m.end():m.end() + 1] != "/"}


def docstring_names() -> dict[str, set[str]]:
    """name -> the files whose docstrings mention it."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "rl_core").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                for name in _names(ast.get_docstring(node) or ""):
                    found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def doc_names() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        for span in re.findall(r"`([^`\n]+)`", path.read_text()):
            for name in _names(span):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def resolves(name: str) -> bool:
    dotted, _, member = name.partition(":")
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and not ".".join(parts[:i]).startswith(exc.name):
                raise  # the module exists but one of its own imports is missing: not a docs problem
            continue
        for attr in parts[i:] + ([member] if member else []):
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_resolves_tells_real_names_from_broken_ones():
    assert resolves("rl_core.launch.preflight.preflight") and resolves("rl_core.samplers.base")
    assert resolves("rl_core.config.schema:RecipeConfig") and resolves("rl_core.config.RecipeConfig.needs_reference_policy")
    assert not resolves("rl_core.config.loader.no_such_function") and not resolves("rl_core.no_such_module")
    assert not resolves("rl_core.config.schema:NoSuchClass")
    assert _names("format `rl_core.rollouts/1`, see rl_core.fsutil.") == {"rl_core.fsutil"}


@pytest.mark.parametrize("source", ["docstrings", "docs"])
def test_every_dotted_rl_core_name_resolves(source):
    names = docstring_names() if source == "docstrings" else doc_names()
    assert len(names) > (30 if source == "docstrings" else 5)  # the scan finds the names at all
    broken = {name: sorted(files) for name, files in sorted(names.items()) if not resolves(name)}
    assert not broken, f"dotted names that do not resolve (rename them where they are mentioned): {broken}"
