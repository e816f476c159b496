"""Build step of rl_core's wheel: the workflow project `rl-core new DIR` writes, as package data.

The repository's Snakefile, workflow/, profiles/, config/, recipes/ and constraints.txt (the
list is rl_core/launch/project_files.py) stay the single source: `build_py` copies them into
the build as rl_core/project/, so a wheel user, who has no clone, gets them with the package.
Everything else about the build is in pyproject.toml. An editable install copies nothing:
`rl-core new` then reads the same files from the checkout (rl_core/launch/new_project.py).
"""

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_project_files", ROOT / "rl_core" / "launch" / "project_files.py")
project_files = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(project_files)


class BuildPyWithProject(build_py):
    """build_py, then the project files into <build>/rl_core/project/."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dest = Path(self.build_lib) / "rl_core" / project_files.PACKAGED_DIR
        shutil.rmtree(dest, ignore_errors=True)
        project_files.copy_project(ROOT, dest)


setup(cmdclass={"build_py": BuildPyWithProject})
