"""Issue 13: which checkpoint a run resumes from, a full disk while writing one, the mode of
the files, and `init-policy --out` never replacing what rl_core did not write."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from rl_core.checkpoint import choose_resume, set_aside_newer, validate_resume_from
from rl_core.checkpoint.store import newest_complete, prune, verify_checkpoint, write_checkpoint
from rl_core.errors import CheckpointError
from rl_core.launch.cli import main as cli_main

from test_bad_state_inputs import RECIPE, ROOT, _checkpoint  # noqa: E402 - same directory


def _steps(tmp: Path, *names: str) -> Path:
    steps = tmp / "run" / "steps"
    for n in names:
        _checkpoint(steps / n)
    return steps


def test_damaged_newest_checkpoint_falls_back_and_is_moved_not_deleted(tmp_path):
    steps = _steps(tmp_path, "step_000004", "step_000008", "step_000012")
    (steps / "step_000012" / "manifest.json").write_text("[]")          # a JSON list
    (steps / "step_000008" / "optimizer.pt").write_bytes(b"z" * 32)     # hash mismatch
    said = []
    chosen = choose_resume(steps, log=said.append)
    assert chosen == steps / "step_000004"
    assert sorted(p.name for p in steps.iterdir()) == ["step_000004"]
    moved = sorted((tmp_path / "run" / "damaged_checkpoints").iterdir())
    assert [p.name.split("-")[0] for p in moved] == ["step_000008", "step_000012"]
    assert (moved[1] / "manifest.json").read_text() == "[]"  # kept as it was
    assert any("falling back" in s and "step_000004" in s for s in said)
    assert any("step_000012" in s and "JSON list" in s for s in said)


def test_no_intact_checkpoint_raises_and_moves_nothing(tmp_path):
    steps = _steps(tmp_path, "step_000004")
    (steps / "step_000004" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="No intact checkpoint.*--resume-from"):
        choose_resume(steps)
    assert (steps / "step_000004").is_dir()
    assert choose_resume(tmp_path / "absent") is None
    assert choose_resume(steps, none_intact="none", log=lambda s: None) is None  # the workflow: previous epoch


def test_resume_from_sets_newer_checkpoints_aside(tmp_path):
    steps = _steps(tmp_path, "step_000004", "step_000008", "step_000012")
    chosen, manifest = validate_resume_from(steps / "step_000004")
    set_aside_newer(chosen, manifest, steps, log=lambda s: None)
    assert sorted(p.name for p in steps.iterdir()) == ["step_000004"]
    assert len(list((tmp_path / "run" / "set_aside_checkpoints").iterdir())) == 2
    assert choose_resume(steps) == steps / "step_000004"


def test_disk_full_while_writing_says_the_previous_checkpoint_is_intact(tmp_path, monkeypatch):
    first = _checkpoint(tmp_path / "steps" / "step_000004")

    def full(tmp: Path) -> None:
        (tmp / "optimizer.pt").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError) as info:
        write_checkpoint(tmp_path / "steps" / "step_000008", full, {"rl_step": 8, "weight_version": 8})
    msg = str(info.value)
    assert "No space left" in msg and str(first) in msg and "intact" in msg and "df -h" in msg
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == ["step_000004"]  # no temporary left
    verify_checkpoint(first)
    # torch wraps the OSError in a RuntimeError: still recognised through the cause chain
    def wrapped(tmp: Path) -> None:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0") from exc

    with pytest.raises(CheckpointError, match="No space left"):
        write_checkpoint(tmp_path / "steps" / "step_000008", wrapped, {"rl_step": 8, "weight_version": 8})
    with pytest.raises(RuntimeError, match="other"):  # any other failure is not disguised
        write_checkpoint(tmp_path / "steps" / "step_000008", lambda t: (_ for _ in ()).throw(RuntimeError("other")),
                         {"rl_step": 8})


def test_checkpoint_files_are_readable_by_others_and_marked(tmp_path):
    def fill(tmp: Path) -> None:
        (tmp / "model").mkdir()
        p = tmp / "model" / "model.safetensors"
        p.write_bytes(b"w")
        os.chmod(p, 0o600)  # what transformers' save_pretrained does

    old = os.umask(0o022)
    try:
        ck = write_checkpoint(tmp_path / "ck", fill, {"rl_step": 1})
    finally:
        os.umask(old)
    assert (ck / "model" / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert json.loads((ck / ".rl_core-output").read_text())["written_by"] == "rl_core checkpoint"
    assert ".rl_core-output" not in json.loads((ck / "manifest.json").read_text())["files"]


def test_prune_removes_only_rl_core_checkpoints(tmp_path):
    steps = _steps(tmp_path, "step_000004", "step_000008")
    foreign = steps / "step_000001"
    foreign.mkdir()
    (foreign / "manifest.json").write_text(json.dumps({"format": "someone-else", "files": {}}))
    prune(steps, 1)
    assert sorted(p.name for p in steps.iterdir()) == ["step_000001", "step_000008"]
    assert newest_complete(steps) == steps / "step_000008"


def test_init_policy_force_replaces_only_its_own_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "pol"
    base = ["init-policy", RECIPE, f"output_dir={tmp_path / 'results'}", "model.warmup.enabled=false",
            "--out", str(out)]
    assert cli_main(base) == 0
    marker = json.loads((out / ".rl_core-output").read_text())
    assert marker["written_by"] == "rl_core policy"
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o666 & ~_umask()}
    assert cli_main(base) == 0 and "reused" in capsys.readouterr().out  # same recipe: kept as is
    (out / "extra.txt").write_text("gone after --force")
    assert cli_main([*base, "--force"]) == 0
    assert not (out / "extra.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pol", "results"]  # no temporaries left


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old
