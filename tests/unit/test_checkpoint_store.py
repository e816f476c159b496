"""Checkpoint directories: atomic, manifest last, verification names the bad file."""

import json
import os

import pytest

from rl_core.checkpoint import is_complete, newest_complete, prune, verify_checkpoint, write_checkpoint
from rl_core.checkpoint.run_state import group_from_json, group_to_json
from rl_core.errors import CheckpointError
from rl_core.types import PromptGroup, Sample


def _fill(tmp):
    (tmp / "model").mkdir()
    (tmp / "model" / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp / "controller_state.json").write_text(json.dumps({"rl_step": 3}))


def test_write_then_verify(tmp_path):
    path = write_checkpoint(tmp_path / "ck", _fill, {"weight_version": 3, "rl_step": 3, "epoch": 0})
    m = verify_checkpoint(path)
    assert m["rl_step"] == 3 and set(m["files"]) == {"model/model.safetensors", "controller_state.json"}
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_truncated_weights_named(tmp_path):
    path = write_checkpoint(tmp_path / "ck", _fill, {"weight_version": 3, "rl_step": 3})
    w = path / "model" / "model.safetensors"
    os.truncate(w, 10)
    with pytest.raises(CheckpointError, match=r"model\.safetensors has 10 bytes; the manifest says 1000"):
        verify_checkpoint(path)


def test_corrupted_file_named(tmp_path):
    path = write_checkpoint(tmp_path / "ck", _fill, {"weight_version": 3, "rl_step": 3})
    (path / "controller_state.json").write_text(json.dumps({"rl_step": 4}))  # same size, other bytes
    with pytest.raises(CheckpointError, match="controller_state.json does not match its sha256"):
        verify_checkpoint(path)


def test_missing_file_named(tmp_path):
    path = write_checkpoint(tmp_path / "ck", _fill, {"weight_version": 3, "rl_step": 3})
    (path / "controller_state.json").unlink()
    with pytest.raises(CheckpointError, match="controller_state.json is missing"):
        verify_checkpoint(path)


def test_killed_writer_leaves_nothing_that_looks_complete(tmp_path):
    def boom(tmp):
        _fill(tmp)
        raise KeyboardInterrupt  # the writer dies half-way

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path / "step_000005", boom, {"rl_step": 5})
    assert not (tmp_path / "step_000005").exists()
    # a directory without manifest (e.g. SIGKILL before the rename on another filesystem) is incomplete
    (tmp_path / "step_000009").mkdir()
    assert not is_complete(tmp_path / "step_000009")
    with pytest.raises(CheckpointError, match="incomplete"):
        verify_checkpoint(tmp_path / "step_000009")


def test_newest_complete_and_prune(tmp_path):
    for n in (2, 4, 6):
        write_checkpoint(tmp_path / f"step_{n:06d}", _fill, {"rl_step": n})
    (tmp_path / "step_000008").mkdir()  # incomplete
    assert newest_complete(tmp_path).name == "step_000006"
    prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if is_complete(p)) == ["step_000004", "step_000006"]


def test_group_json_round_trip():
    g = PromptGroup("g", 3, 1, {"prompt": "1+1="}, [Sample([1, 2], [3, 0], [-0.5, -0.25], 1.0, "stop", 2, 3,
                                                           {"correct": 1.0}, False, {"text": "3"})], 2, 3, 7)
    assert group_from_json(json.loads(json.dumps(group_to_json(g)))) == g
