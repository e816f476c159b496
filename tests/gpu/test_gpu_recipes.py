"""The one-GPU recipes (recipes/gpu-*.yaml) on CUDA (marked `gpu`, skipped without CUDA): the
initial-policy stage builds the >= 100 M-parameter Qwen2-shaped model and warms it up on the
GPU to the recipe's target, then async GRPO runs with the native engine colocated and the
compiled torch trainer, through `snakemake --cores 2` (a few RL steps: a check, not a speed;
bench/e2e_gpu.py times the full runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("snakemake", reason="the workflow needs snakemake (pip install rl_core)")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["gpu-addition", "gpu-repeat"])
def test_gpu_recipe_runs_on_cuda(tmp_path, name):
    for d in ("recipes", "data", "config"):
        (tmp_path / d).symlink_to(ROOT / d)
    sets = ["grpo.max_num_steps=4", "grpo.max_num_epochs=1", "validation.val_period=0", "validation.max_val_samples=16",
            "evaluation.max_samples=16"]
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path),
           "--cores", "2", "--config", f"recipe=recipes/{name}.yaml", "run=gpu", f"overrides={json.dumps(sets)}"]
    paths = [str(ROOT)] + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    out = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    r = tmp_path / "results" / "gpu"
    report = json.loads((r / "init_policy" / "init_report.json").read_text())
    assert report["num_parameters"] >= 100_000_000 and report["architecture"] == "qwen2"
    assert report["warmup"]["device"] == "cuda" and report["warmup"]["accuracy"] >= report["warmup"]["target_accuracy"] > 0
    assert json.loads((r / "epoch_1" / "checkpoint" / "manifest.json").read_text())["rl_step"] == 4
