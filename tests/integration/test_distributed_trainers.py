"""The whole asynchronous RL loop with the multi-process trainer backends (CPU, counted in RL steps).

- fsdp2 on 2 processes under torchrun: rank 0 runs the controller, rank 1 follows; refit
  goes through the filesystem handoff (versioned safetensors directories, READY markers,
  old versions removed); step checkpoints and the final policy are written by rank 0.
- megatron on 1 process: the same loop with Megatron-core's GPTModel, weights converted
  back to the HF layout at every refit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "tests" / "recipes" / "tiny-addition-loop.yaml"
STEPS = 3


def _train(tmp_path: Path, warm_policy: Path, name: str, nproc: int, *overrides: str) -> Path:
    run_dir = tmp_path / name
    shutil.copytree(warm_policy, run_dir / "init_policy")
    args = ["-m", "rl_core.launch.cli", "train", str(RECIPE), f"output_dir={tmp_path}", f"run_name={name}",
            f"grpo.max_num_steps={STEPS}", "validation.max_val_samples=16", "logging.tensorboard=false",
            "checkpoint.save_every_steps=2", *overrides]
    if nproc > 1:
        from tests.helpers.trainers import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), *args]
    else:
        cmd = [sys.executable, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run_dir


def _check_run(run_dir: Path) -> list[dict]:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rl_steps"] == STEPS
    assert (run_dir / "final_policy" / "config.json").is_file()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind", "train") == "train" and "train/loss" in r]
    assert len(train) == STEPS and all(r["train/num_tokens"] > 0 for r in train)
    return train


def test_fsdp2_two_processes_with_filesystem_refit(tmp_path, warm_policy):
    run_dir = _train(tmp_path, warm_policy, "fsdp2", 2, "trainer.backend=fsdp2", "trainer.weight_sync.type=filesystem",
                     "trainer.weight_sync.keep_last_versions=2")
    train = _check_run(run_dir)
    assert all(r["refit/bytes"] > 0 and r["refit/sync_write_s"] > 0 for r in train)
    versions = sorted(p.name for p in (run_dir / "weights").iterdir() if p.name.startswith("v"))
    assert versions == [f"v{STEPS - 1:09d}", f"v{STEPS:09d}"]
    assert all((run_dir / "weights" / v / "READY").is_file() for v in versions)
    assert (run_dir / "steps").is_dir()


def test_megatron_one_process(tmp_path, warm_policy):
    _check_run(_train(tmp_path, warm_policy, "megatron", 1, "trainer.backend=megatron"))
