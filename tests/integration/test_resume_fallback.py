"""Issue 13: a run whose newest step checkpoint is damaged resumes, with the same command, from
the newest intact one (the damaged one is moved aside, not deleted, and the fallback is
printed), and the resumed run's summary.json and final CLI line keep the before-RL accuracy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rl_core.launch.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "tests" / "recipes" / "tiny-addition-loop.yaml")


def test_damaged_newest_checkpoint_falls_back_and_keeps_before_rl_accuracy(tmp_path, warm_policy, monkeypatch,
                                                                            capsys):
    monkeypatch.chdir(ROOT)
    run = tmp_path / "r"
    shutil.copytree(warm_policy, run / "init_policy")
    argv = ["train", RECIPE, f"output_dir={tmp_path}", "run_name=r", "grpo.max_num_steps=4",
            "checkpoint.save_every_steps=2", "checkpoint.keep_last=3", "validation.max_val_samples=32",
            "logging.tensorboard=false"]
    assert cli_main(argv) == 0
    first = json.loads((run / "summary.json").read_text())
    before = first["val_start"]["accuracy"]
    capsys.readouterr()

    # the newest checkpoint loses its controller state's trainer entry (hashes made consistent):
    # a structurally damaged checkpoint that verify alone would not catch
    newest = run / "steps" / "step_000004"
    from rl_core.checkpoint.store import sha256_file

    state_path = newest / "controller_state.json"
    state = json.loads(state_path.read_text())
    del state["trainer"]
    state_path.write_text(json.dumps(state))
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["controller_state.json"] = {"size": state_path.stat().st_size, "sha256": sha256_file(state_path)}
    (newest / "manifest.json").write_text(json.dumps(manifest))

    assert cli_main(argv) == 0  # the same command
    out = capsys.readouterr()
    text = out.out + out.err
    assert "falling back to the newest intact checkpoint" in text and "step_000002" in text
    assert "[resume] continuing from" in text
    moved = list((run / "damaged_checkpoints").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith("step_000004")
    assert "trainer" not in json.loads((moved[0] / "controller_state.json").read_text())  # kept as it was
    again = json.loads((run / "summary.json").read_text())
    assert again["start_step"] == 2 and again["rl_steps"] == 4
    assert again["val_start"] is not None and again["val_start"]["accuracy"] == before
    assert f"{before:.3f} before RL" in out.out
