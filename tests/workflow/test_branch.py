"""Rerun recipe (a): branch a new run from epoch 1 of the reference run with a changed knob."""

from __future__ import annotations

import json

from rl_core.metrics.logger import read_jsonl

from tests.helpers.workflow import RUN, copy_run, hf_overrides, job_stats, manifest, short_config, snakemake


def test_branch_from_an_epoch_with_a_changed_learning_rate(reference_run, tmp_path):
    wd = copy_run(reference_run, tmp_path / "wd")
    args = ["--cores", "2", "results/lr-branch/epoch_2/checkpoint",  # targets before --config, which eats the rest
            *short_config("lr-branch", [*hf_overrides(reference_run), "trainer.lr=3e-4"],
                          f"branch_from=results/{RUN}/epoch_1")]
    plan = snakemake(wd, "-n", *args)
    assert plan.returncode == 0, plan.stderr
    # validate_recipe (the recipe of record) is not upstream of the stages: this target does not need it
    assert job_stats(plan.stdout) == {"branch_epoch": 1, "train_epoch": 1}
    out = snakemake(wd, *args)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    src, b = wd / "results" / RUN, wd / "results" / "lr-branch"
    assert json.loads((b / "epoch_2" / "checkpoint" / "resolved_config.json").read_text())["trainer"]["lr"] == 3e-4
    # epoch 1 is the source's (linked, not retrained); epoch 2 starts from it with the new learning rate
    assert (b / "epoch_1" / "checkpoint" / "optimizer.pt").stat().st_ino == \
        (src / "epoch_1" / "checkpoint" / "optimizer.pt").stat().st_ino
    assert "[resume]" not in (b / "logs" / "train_epoch_2.log").read_text()
    ref, got = read_jsonl(src / "epoch_2" / "metrics.jsonl", "train"), read_jsonl(b / "epoch_2" / "metrics.jsonl", "train")
    assert [r["step"] for r in got] == list(range(7, 13))
    assert got[0]["train/lr"] == 3e-4 and ref[0]["train/lr"] == 1e-4
    # step 7 trains on the groups epoch 1 generated ahead (same samples); the updates differ
    assert got[0]["train/reward_mean"] == ref[0]["train/reward_mean"]
    m_ref, m_got = manifest(src / "epoch_2" / "checkpoint"), manifest(b / "epoch_2" / "checkpoint")
    assert m_got["rl_step"] == 12
    assert m_got["files"]["model/model.safetensors"]["sha256"] != m_ref["files"]["model/model.safetensors"]["sha256"]
