"""Preemption and SIGKILL of the controller job, then the same command again.

One workflow run of the short recipe (reproducible mode) is interrupted twice:
1. during epoch 1, its controller gets SIGUSR2 (what Slurm sends before a time limit or a
   preemption): submitit calls `TrainEpochJob.checkpoint()`, the job requeues itself and
   resumes from the newest step checkpoint, inside the same snakemake run;
2. during epoch 2, its controller is SIGKILLed: the snakemake run fails; the same command
   again resumes epoch 2 from its newest step checkpoint and completes.
Its final step count, metrics and checkpoints must equal the uninterrupted reference run's,
the weights bit for bit (manifest sha256)."""

from __future__ import annotations

import json
import os
import signal

from rl_core.metrics.logger import read_jsonl

from tests.helpers.workflow import RUN, hf_overrides, make_workdir, manifest, short_config, snakemake, wait_for

SAME_BITS = ("model/model.safetensors", "optimizer.pt")


def _controller_pid(epoch_dir) -> int:
    return int(json.loads((epoch_dir / ".controller.lock").read_text())["pid"])


def test_preempted_and_killed_run_equals_uninterrupted(reference_run, tmp_path):
    wd = make_workdir(tmp_path / "wd")
    args = ["--cores", "2", *short_config(RUN, hf_overrides(reference_run))]
    r = wd / "results" / RUN
    log = open(tmp_path / "snakemake.out", "w+")
    proc = snakemake(wd, *args, popen=True, stdout=log)
    try:
        # 1. preempt epoch 1 after its first step checkpoint
        assert wait_for(r / "epoch_1" / "steps" / "step_000002" / "manifest.json", 600, proc), "no step checkpoint"
        os.kill(_controller_pid(r / "epoch_1"), signal.SIGUSR2)
        assert not (r / "epoch_1" / "checkpoint").exists(), "epoch 1 ended before it could be preempted"
        # 2. kill epoch 2's controller after its first step checkpoint
        assert wait_for(r / "epoch_2" / "steps" / "step_000008" / "manifest.json", 600, proc), "epoch 2 never ran"
        os.kill(_controller_pid(r / "epoch_2"), signal.SIGKILL)
        assert not (r / "epoch_2" / "checkpoint").exists(), "epoch 2 ended before it could be killed"
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    out = (tmp_path / "snakemake.out").read_text()
    assert proc.returncode != 0, out
    assert "train_epoch: Training epoch 2 (job" in out and "ended without a result" in out, out[-3000:]

    again = snakemake(wd, *args)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]

    log1 = (r / "logs" / "train_epoch_1.log").read_text()
    assert "requeueing epoch 1" in log1 and "[resume] epoch 1: continuing from" in log1
    assert "step_000002 (RL step 2)" in log1 or "step_000004 (RL step 4)" in log1
    log2 = (r / "logs" / "train_epoch_2.log").read_text()
    assert "[resume] epoch 2: continuing from" in log2

    ref = reference_run / "results" / RUN
    for k in (1, 2):
        got, want = manifest(r / f"epoch_{k}" / "checkpoint"), manifest(ref / f"epoch_{k}" / "checkpoint")
        assert got["rl_step"] == want["rl_step"] == 6 * k
        for f in SAME_BITS:
            assert got["files"][f]["sha256"] == want["files"][f]["sha256"], f"epoch {k}: {f} differs"
        a = read_jsonl(ref / f"epoch_{k}" / "metrics.jsonl", "train")
        b = read_jsonl(r / f"epoch_{k}" / "metrics.jsonl", "train")
        assert [x["step"] for x in b] == [x["step"] for x in a] == list(range(6 * k - 5, 6 * k + 1))
        for x, y in zip(a, b):
            assert (x["train/reward_mean"], x["train/loss"]) == (y["train/reward_mean"], y["train/loss"])
        va = json.loads((ref / f"epoch_{k}" / "validation.json").read_text())
        vb = json.loads((r / f"epoch_{k}" / "validation.json").read_text())
        assert va["accuracy"] == vb["accuracy"]
    assert json.loads((r / "epoch_2" / "summary.json").read_text())["end_step"] == 12
    assert (r / "report.html").is_file()
