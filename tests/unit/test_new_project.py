"""`rl-core new DIR` (from this checkout: an editable install reads the project files from it;
tests/workflow/test_packaging.py runs it from a wheel) and recipe errors that point at real folders."""

from __future__ import annotations

import filecmp
import subprocess
import sys

import pytest

from rl_core.launch.preflight import load_recipe
from rl_core.errors import ArgumentError, RecipeError
from rl_core.launch.new_project import new_project, template_root
from rl_core.launch.project_files import PROJECT_FILES

from tests.helpers.paths import ROOT


def _same_tree(a, b) -> None:
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__", "rl_core-requirement.txt"])  # the one file new adds
    assert not (cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files), (a, cmp.left_only,
                                                                                         cmp.right_only, cmp.diff_files)
    for sub in cmp.common_dirs:
        _same_tree(a / sub, b / sub)


def test_new_writes_the_repository_workflow_and_the_recipes_data(tmp_path):
    assert template_root() == ROOT  # an editable install: the checkout is the single source
    out = tmp_path / "proj"
    info = new_project(out)
    assert "tiny-addition-short.yaml" in info["recipes"]
    for name in PROJECT_FILES:
        if (ROOT / name).is_dir():
            _same_tree(ROOT / name, out / name)
        else:
            assert (out / name).read_bytes() == (ROOT / name).read_bytes(), name
    for task in ("addition", "arithmetic"):  # generated as `rl-core make-data` does: the repository's bytes
        for f in ("train.jsonl", "val.jsonl"):
            assert (out / "data" / task / f).read_bytes() == (ROOT / "data" / task / f).read_bytes(), (task, f)
    assert "rl_core" in (out / "workflow" / "envs" / "rl_core-requirement.txt").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name != "proj"]  # no temporary sibling left


def test_new_never_writes_into_a_folder_it_did_not_create(tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("keep")
    with pytest.raises(ArgumentError, match="is not empty"):
        new_project(busy)
    assert [p.name for p in busy.iterdir()] == ["mine.txt"]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ArgumentError, match="is not a folder"):
        new_project(tmp_path / "afile")
    empty = tmp_path / "empty"
    empty.mkdir()
    new_project(empty)  # an empty folder is fine
    assert (empty / "Snakefile").is_file()


def test_cli_new_prints_the_next_commands(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rl_core.launch.cli", "new", str(tmp_path / "p")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "snakemake --cores 2 --config recipe=recipes/tiny-addition-short.yaml" in out.stdout
    again = subprocess.run([sys.executable, "-m", "rl_core.launch.cli", "new", str(tmp_path / "p")], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "is not empty" in again.stderr and "Traceback" not in again.stderr


def test_a_missing_recipe_points_at_a_recipes_folder_only_where_there_is_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a wheel user's folder: no recipes/
    with pytest.raises(RecipeError) as info:
        load_recipe("recipes/tiny-addition.yaml")
    msg = str(info.value)
    assert "has no recipes/ folder" in msg and "rl-core new DIR" in msg
    assert str(tmp_path / "recipes") + "/" not in msg.replace("DIR/recipes/", "")
    new_project(tmp_path / "proj")
    monkeypatch.chdir(tmp_path / "proj")
    with pytest.raises(RecipeError) as info:
        load_recipe("recipes/nope.yaml")
    assert "recipes/tiny-addition-short.yaml" in str(info.value) and "rl-core new" not in str(info.value)
