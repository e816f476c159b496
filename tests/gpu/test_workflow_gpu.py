"""The workflow on a GPU machine (marked `gpu`, skipped without CUDA): the local submitit
executor hands the controller job the GPUs this process sees (submitit sets
CUDA_VISIBLE_DEVICES for local jobs), and the short recipe runs end to end on CUDA through
`snakemake --cores 2` with the controller, validation and evaluation on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl_core.config import read_recipe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# both are rl_core dependencies; a GPU image with rl_core installed without its dependencies may lack them
pytest.importorskip("submitit", reason="the workflow's controller job needs submitit (pip install rl_core)")
pytest.importorskip("snakemake", reason="the workflow needs snakemake (pip install rl_core)")

from rl_core.launch.job import make_executor, wait_for_jobs  # noqa: E402  (imports submitit)
ROOT = Path(__file__).resolve().parents[2]


def test_local_job_sees_the_same_gpus(tmp_path):
    cluster = read_recipe(ROOT / "recipes" / "tiny-addition.yaml").cluster
    ex = make_executor("local", tmp_path, cluster.controller, cluster, "gpu-probe")
    (count,) = wait_for_jobs([ex.submit(torch.cuda.device_count)], "probe", poll_interval_s=0.5)
    assert count == torch.cuda.device_count() >= 1


def test_short_recipe_runs_on_cuda(tmp_path):
    for name in ("recipes", "data", "config"):
        (tmp_path / name).symlink_to(ROOT / name)
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path),
           "--cores", "2", "--config", "recipe=recipes/tiny-addition-short.yaml", "run=gpu",
           'overrides=["runtime.device=cuda"]']
    # the jobs run in tmp_path: relative PYTHONPATH entries (a checkout named as ".") made absolute, and this
    # checkout first, so that the submitit job imports the rl_core under test
    paths = [str(ROOT)] + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    r = tmp_path / "results" / "gpu"
    assert json.loads((r / "epoch_2" / "checkpoint" / "manifest.json").read_text())["rl_step"] == 12
    assert json.loads((r / "evaluation.json").read_text())["results"]
    assert (r / "report.html").read_text().count("data:image/png;base64,") == 5
