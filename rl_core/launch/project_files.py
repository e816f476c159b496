"""What a workflow project is made of: the repository paths `rl-core new DIR` writes.

The repository's own Snakefile, workflow/, profiles/, config/, recipes/ and constraints.txt
are the single source of the project; the build step (setup.py) copies these paths into the
wheel as rl_core/project/, and `rl_core.launch.new_project` copies them from there (or, in an
editable install, from the checkout itself) into the new project, both with `copy_project`.
setup.py loads this module by its path, without importing rl_core: it imports the standard
library only.
"""

import shutil
from pathlib import Path

PROJECT_FILES = ("Snakefile", "workflow", "profiles", "config", "recipes", "constraints.txt")
"""Paths relative to the repository root (files, or folders copied whole)."""

PACKAGED_DIR = "project"
"""Where the build step puts them inside the installed package: rl_core/project/."""


def copy_project(root: Path, dest: Path) -> None:
    """Copy PROJECT_FILES from `root` into `dest` (Python's byte-code caches left out)."""
    for name in PROJECT_FILES:
        src, dst = Path(root) / name, Path(dest) / name
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
