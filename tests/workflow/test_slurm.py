"""The short recipe with `--profile profiles/slurm` on a real one-node Slurm cluster.

Every computing rule is an sbatch job of snakemake's Slurm executor; train_epoch submits
the controller as a submitit Slurm job and evaluate a submitit job array. `sacct` must
show all of them COMPLETED, and every output must exist. Needs root (the cluster is
started by ci/slurm-local/up.sh); skipped otherwise, with the reason."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.helpers.workflow import PLOTS, ROOT, RUN, hf_overrides, make_workdir, manifest, short_config, snakemake

SBATCH_RULES = {"init_policy": 1, "validate_init": 1, "validate_epoch": 2, "archive_rollouts": 2, "report": 1}


def _sacct(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,JobName,State", "-j", ",".join(job_ids)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return {line.split("|")[0]: (line.split("|")[1], line.split("|")[2]) for line in out.splitlines() if line}


@pytest.mark.slurm
def test_short_recipe_on_slurm(slurm_cluster, reference_run, tmp_path):
    wd = make_workdir(tmp_path / "wd")
    out = snakemake(wd, "--profile", str(ROOT / "profiles" / "slurm"), *short_config(RUN, hf_overrides(reference_run)))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    r = wd / "results" / RUN

    # every output
    for k in (1, 2):
        assert manifest(r / f"epoch_{k}" / "checkpoint")["rl_step"] == 6 * k
        for name in ("validation.json", "rollouts.h5", "summary.json", "metrics.jsonl"):
            assert (r / f"epoch_{k}" / name).is_file(), name
    assert (r / "init_validation.json").is_file() and (r / "evaluation.json").is_file()
    assert (r / "report.html").read_text().count("data:image/png;base64,") == len(PLOTS)

    # snakemake's sbatch jobs, as its Slurm executor reported them
    rule_jobs: dict[str, list[str]] = {}
    for job_id, rule in re.findall(r"submitted with SLURM jobid (\d+) \(log: \S*/rule_(\w+)/", out.stdout + out.stderr):
        rule_jobs.setdefault(rule, []).append(job_id)
    assert {rule: len(ids) for rule, ids in rule_jobs.items()} == SBATCH_RULES
    # submitit's jobs: the controller of each epoch and the evaluation array
    train_ids = [json.loads((r / f"epoch_{k}" / "submitit" / "job.json").read_text())["job_id"] for k in (1, 2)]
    for k in (1, 2):
        assert f"[submit] epoch {k}: slurm job {train_ids[k - 1]}" in (r / "logs" / f"train_epoch_{k}.log").read_text()
    eval_log = (r / "logs" / "evaluate.log").read_text()
    eval_ids = eval_log.split("[evaluate] submitted slurm array: ", 1)[1].splitlines()[0].split(", ")
    # one array task per (chosen checkpoint, eval set): two when the best epoch is not the last
    # (submitit submits a one-task array as a plain job, "<id>" instead of "<array id>_0")
    num_tasks = len(json.loads((r / "evaluation.json").read_text())["results"])
    assert len(eval_ids) == num_tasks >= 1
    assert num_tasks == 1 or all("_" in i for i in eval_ids)

    acct = _sacct([i for ids in rule_jobs.values() for i in ids] + train_ids + [eval_ids[0].split("_")[0]])
    for ids in rule_jobs.values():
        for i in ids:
            assert acct[i][1] == "COMPLETED", (i, acct[i])
    for k, i in enumerate(train_ids, start=1):
        assert acct[i] == (f"rl_core-train-{RUN}-e{k}", "COMPLETED")
    for i in eval_ids:
        assert acct[i] == (f"rl_core-eval-{RUN}", "COMPLETED")
