"""A 2-task FSDP2 trainer under a real local Slurm (ci/slurm-local), marked `slurm`.

1. `srun -n 2` of `rl_core.train.check_step`: the two tasks meet through the Slurm step's
   environment (no torchrun), rank 0 drives, and the step equals the one-process torch
   trainer's (same tolerances as tests/unit/test_fsdp_step.py).
2. The workflow with `--profile profiles/slurm`: epoch 1 of the short recipe with
   `trainer.backend=fsdp2` and a 2-task controller job (submitit on Slurm): rank 0 runs
   the controller, rank 1 follows; `sacct` shows the job step ran 2 tasks.
Skipped (with the reason printed) when not root: the cluster fixture needs root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import pytest

from tests.helpers.workflow import ROOT, make_workdir, short_config, snakemake

from tests.helpers.trainers import assert_same_step, max_weight_diff, run_check, tiny_hf_dir

pytestmark = [pytest.mark.slurm]
TWO_TASKS = ["trainer.backend=fsdp2", "cluster.trainer.num_processes_per_node=2", "cluster.controller.tasks_per_node=2",
             "cluster.controller.cpus_per_task=1"]


def test_srun_two_task_fsdp2_step_matches_torch(slurm_cluster, tmp_path):
    model = tiny_hf_dir(tmp_path / "model", "qwen2")
    ref, w_ref = run_check(model, tmp_path, "torch")
    out, weights = tmp_path / "slurm.json", tmp_path / "slurm.safetensors"
    cmd = ["srun", "--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=1", "--mem=4000", "--time=10",
           "--job-name=rl-core-fsdp2-check", sys.executable, "-m", "rl_core.train.check_step", str(model),
           "--backend", "fsdp2", "--out", str(out), "--save-weights", str(weights),
           *[a for s in TWO_TASKS[1:3] for a in ("--set", s)]]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    got = json.loads(out.read_text())
    assert got["source"] == "slurm" and got["world_size"] == 2
    assert_same_step(ref, got, 1e-5)
    from safetensors.torch import load_file

    assert max_weight_diff(w_ref, load_file(str(weights))) < 1e-4


@pytest.mark.slow
def test_slurm_profile_runs_a_two_task_fsdp2_controller_job(slurm_cluster, tmp_path):
    wd = make_workdir(tmp_path / "wd")
    target = "results/fsdp2/epoch_1/summary.json"
    # no supervised warm-up: this test is about the 2-task controller job, not about learning
    snakemake(wd, "--profile", str(ROOT / "profiles" / "slurm"), target,
              *short_config("fsdp2", [*TWO_TASKS, "model.warmup.enabled=false"]), timeout=1500, check=True)
    summary = json.loads((wd / target).read_text())
    assert summary["rl_steps"] == 6
    assert (wd / "results/fsdp2/epoch_1/checkpoint/manifest.json").is_file()
    # the recipe the epoch trained with (the run's resolved_config.json is written only for the default target)
    resolved = json.loads((wd / "results/fsdp2/epoch_1/checkpoint/resolved_config.json").read_text())
    assert resolved["trainer"]["backend"] == "fsdp2"
    # the controller job ran its trainer as one Slurm step of 2 tasks
    from rl_core.launch.job import JOB_RECORD

    job_id = json.loads((wd / "results/fsdp2/epoch_1/submitit" / JOB_RECORD).read_text())["job_id"]
    deadline = time.monotonic() + 60  # accounting records the end of a step a little after it
    while True:
        acct = subprocess.run(["sacct", "-j", str(job_id), "-n", "-P", "-o", "JobID,NTasks,State"],
                              capture_output=True, text=True, timeout=30).stdout
        rows = [line.split("|") for line in acct.splitlines() if line.strip()]
        if any(r[0].startswith(f"{job_id}.") and r[1] == "2" and r[2] == "COMPLETED" for r in rows):
            break
        assert time.monotonic() < deadline, acct
        time.sleep(2)
