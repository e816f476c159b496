"""A user's own module for a test: written under the test's tmp_path and importable by name,
found through sys.path as a user's code is (rl_core.plugins.load_target); forgotten again after."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def user_module(directory: Path, monkeypatch, name: str, source: str) -> Iterator[str]:
    """`directory/<name>.py` holding `source`, on sys.path while the block runs; yields `name`."""
    (directory / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(directory))
    try:
        yield name
    finally:
        sys.modules.pop(name, None)
