"""Outputs that line up: the rollout spool / rollouts.h5 number RL steps and epochs as
metrics.jsonl, the step checkpoints and the workflow's epoch_<k> folders do (1-based), and a
held-out validation reaches TensorBoard at its RL step."""

from __future__ import annotations

import asyncio
import json

from rl_core.archive import RolloutArchive, compile_spool
from rl_core.controller.controller import Controller
from rl_core.metrics.logger import read_jsonl
from rl_core.rollout.spool import RolloutSpool

from tests.helpers.fakes import make_parts
from tests.helpers.recipes import controller_recipe


def test_spool_and_archive_number_steps_and_epochs_as_the_metrics(tmp_path):
    cfg = controller_recipe(logging={"jsonl": True})
    parts = make_parts(cfg, num_examples=8)  # 2 RL steps per pass over the data: 6 steps = 3 data epochs
    spool = tmp_path / "rollouts.spool"
    asyncio.run(Controller(cfg, parts, tmp_path, total_steps=6, spool_dir=spool).run())
    metrics = read_jsonl(tmp_path / "metrics.jsonl", "train")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in spool.glob("step_*.json")) == [f"step_{s:06d}.json" for s in range(1, 7)]
    for m in metrics:
        rec = json.loads((spool / f"step_{m['step']:06d}.json").read_text())
        assert rec["step"] == m["step"] and rec["weight_version"] == m["step"] - 1
        assert max(g["epoch"] for g in rec["groups"]) == m["epoch"]
        assert all(1 <= g["target_step"] <= m["step"] for g in rec["groups"])
    assert [m["epoch"] for m in metrics] == [1, 1, 2, 2, 3, 3]  # 1-based, as epoch_1/ holds the first pass

    out = tmp_path / "epoch_1" / "rollouts.h5"
    compile_spool(spool, out, attrs={"run": "r", "epoch": 1})
    with RolloutArchive(out) as ar:
        assert ar.summary()["steps"] == [1, 6]
        assert sorted(set(ar.column("steps/step").tolist())) == [m["step"] for m in metrics]
        assert sorted(set(ar.column("groups/epoch").tolist())) == [1, 2, 3]


def test_truncate_after_keeps_the_steps_a_resume_point_has_done(tmp_path):
    spool = RolloutSpool(tmp_path / "spool")
    for step in range(1, 6):
        spool.write(step, step - 1, [])
    spool.truncate_after(3)  # a step checkpoint at RL step 3: steps 1..3 are done, 4 and 5 are trained again
    assert spool.steps() == [1, 2, 3]


def test_validations_reach_tensorboard_at_their_rl_steps_in_step_order(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rl_core.launch.stages import log_validations_tensorboard

    tb = tmp_path / "tensorboard" / "validation"
    base = {"num_prompts": 64, "pass_at_k": {"1": 0.5, "2": 0.6}, "reward_mean": 0.4, "mean_length": 3.0,
            "truncation_rate": 0.0, "seconds": 1.0}
    # in the order the validations happened to finish, not the RL step order
    results = [{**base, "weight_version": 12, "accuracy": 0.9, "pass@2": 0.95},
               {**base, "weight_version": 0, "accuracy": 0.1, "pass@2": 0.2},
               {**base, "weight_version": 6, "accuracy": 0.5, "pass@2": 0.6}]
    log_validations_tensorboard(results, tb)
    (tb / "events.out.tfevents.0.other").write_bytes(b"")  # not ours: left alone
    results[2] = {**results[2], "accuracy": 0.7}  # a re-validation replaces the earlier file
    log_validations_tensorboard(results, tb)
    assert len(list(tb.glob("events.out.tfevents.*rl_core-validation"))) == 1
    assert (tb / "events.out.tfevents.0.other").exists()
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars("val/accuracy")] == [(0, 0.1), (6, 0.7), (12, 0.9)]
    assert [e.step for e in acc.Scalars("val/pass@2")] == [0, 6, 12]
    assert {"val/pass_at_k/1", "val/reward_mean", "val/truncation_rate"} <= set(acc.Tags()["scalars"])
    assert "val/num_prompts" not in acc.Tags()["scalars"]


def test_the_progress_line_counts_rl_steps_as_the_metrics(tmp_path, capsys):
    """One numbering everywhere: the first epoch of a 6-step run (stop at 3) prints `step 3/6`,
    not `3/3`; a process continuing at step 3 prints `step 4/6` on (its ETA is to its own stop)."""
    import io

    from rl_core.metrics.progress import Progress

    cfg = controller_recipe(logging={"jsonl": True, "progress": "auto"})
    asyncio.run(Controller(cfg, make_parts(cfg, num_examples=8), tmp_path, total_steps=6, stop_step=3).run())
    err = capsys.readouterr().err
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl", "train")] == [1, 2, 3]
    lines = [line for line in err.splitlines() if line.startswith("[train] step")]
    assert lines[0].startswith("[train] step 1/6 ") and lines[-1].startswith("[train] step 3/6 "), lines
    assert lines[-1].endswith("(to step 3)")
    out = io.StringIO()
    later = Progress(6, "log", out, start=3, stop=6)
    for step in (4, 5, 6):
        later.update(step, reward=0.5)
    assert [line.split(" |")[0] for line in out.getvalue().splitlines()] == [
        "[train] step 4/6", "[train] step 5/6", "[train] step 6/6"]
    assert "(to step" not in out.getvalue()  # the run's end
