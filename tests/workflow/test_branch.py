"""Rerun recipe (a): branch a new run from epoch 1 of the reference run with a changed knob.

The branch never changes its source: after the branch has run (its epoch 2 first, then the
README's command with the default target), every file of the source run has its old bytes
and mtime, and `snakemake -n` on the source has nothing to do. The linked epoch's archive and
validation are the source's (copied), not recomputed."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from rl_core.metrics.logger import read_jsonl

from tests.helpers.workflow import RUN, copy_run, hf_overrides, job_stats, manifest, short_config, snakemake


def _snapshot(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under `root` (hidden ones too): sha256, mtime (ns) and mode."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mtime_ns, st.st_mode)
    return out


def test_branch_from_an_epoch_with_a_changed_learning_rate(reference_run, tmp_path):
    wd = copy_run(reference_run, tmp_path / "wd")
    src, b = wd / "results" / RUN, wd / "results" / "lr-branch"
    before = _snapshot(src)
    assert any(k.endswith(".snakemake_timestamp") for k in before)  # the markers a hard link used to share
    args = ["--cores", "2", "results/lr-branch/epoch_2/checkpoint",  # targets before --config, which eats the rest
            *short_config("lr-branch", [*hf_overrides(reference_run), "trainer.lr=3e-4"],
                          f"branch_from=results/{RUN}/epoch_1")]
    plan = snakemake(wd, "-n", *args)
    assert plan.returncode == 0, plan.stderr
    # validate_recipe (the recipe of record) is not upstream of the stages: this target does not need it
    assert job_stats(plan.stdout) == {"branch_epoch": 1, "train_epoch": 1}
    out = snakemake(wd, *args)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    assert json.loads((b / "epoch_2" / "checkpoint" / "resolved_config.json").read_text())["trainer"]["lr"] == 3e-4
    # epoch 1 is the source's (linked, not retrained); epoch 2 starts from it with the new learning rate
    assert (b / "epoch_1" / "checkpoint" / "optimizer.pt").stat().st_ino == \
        (src / "epoch_1" / "checkpoint" / "optimizer.pt").stat().st_ino
    # what Snakemake touches, or rl_core appends to, is the branch's own file
    for rel in ("summary.json", "metrics.jsonl", "checkpoint/.snakemake_timestamp"):
        assert (b / "epoch_1" / rel).stat().st_ino != (src / "epoch_1" / rel).stat().st_ino, rel
    assert "[resume]" not in (b / "logs" / "train_epoch_2.log").read_text()
    ref, got = read_jsonl(src / "epoch_2" / "metrics.jsonl", "train"), read_jsonl(b / "epoch_2" / "metrics.jsonl", "train")
    assert [r["step"] for r in got] == list(range(7, 13))
    assert got[0]["train/lr"] == 3e-4 and ref[0]["train/lr"] == 1e-4
    # step 7 trains on the groups epoch 1 generated ahead (same samples); the updates differ
    assert got[0]["train/reward_mean"] == ref[0]["train/reward_mean"]
    m_ref, m_got = manifest(src / "epoch_2" / "checkpoint"), manifest(b / "epoch_2" / "checkpoint")
    assert m_got["rl_step"] == 12
    assert m_got["files"]["model/model.safetensors"]["sha256"] != m_ref["files"]["model/model.safetensors"]["sha256"]

    # the rest of the README's command (default target): the linked epoch's archive and validations
    # are the source's results, copied; only epoch 2 is archived and validated
    full = ["--cores", "2", *short_config("lr-branch", [*hf_overrides(reference_run), "trainer.lr=3e-4"],
                                          f"branch_from=results/{RUN}/epoch_1")]
    rest = snakemake(wd, *full)
    assert rest.returncode == 0, rest.stdout[-3000:] + rest.stderr[-3000:]
    ran = job_stats(rest.stdout + rest.stderr)
    assert (ran.get("branch_archive"), ran.get("branch_validation"), ran.get("branch_init_validation")) == (1, 1, 1), ran
    assert (ran.get("archive_rollouts"), ran.get("validate_epoch")) == (1, 1) and "validate_init" not in ran, ran
    for rel in ("logs/archive_rollouts_1.log", "logs/validate_epoch_1.log", "logs/validate_init.log"):
        assert not (b / rel).exists(), rel  # never recomputed
    for rel in ("epoch_1/rollouts.h5", "epoch_1/validation.json", "init_validation.json"):
        assert (b / rel).read_bytes() == (src / rel).read_bytes(), rel
        assert (b / rel).stat().st_ino != (src / rel).stat().st_ino, rel
    assert "held-out accuracy:" in rest.stdout and (b / "report.html").is_file()

    # the source: every file as it was (bytes, mtime, mode), and nothing for snakemake to do
    assert _snapshot(src) == before
    again = snakemake(wd, "-n", "--cores", "2", *short_config())
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, again.stdout[-3000:]
    assert _snapshot(src) == before
