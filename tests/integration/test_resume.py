"""Exact resume of an asynchronous run: two reproducible runs give the same weights, and a
run SIGKILLed after a step checkpoint, then restarted with the same command, ends with
bit-identical weights, the same step count and the same metrics as an uninterrupted run."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rl_core.metrics.logger import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
STEPS = 24
ARGS = [f"grpo.max_num_steps={STEPS}", "checkpoint.save_every_steps=8", "async_rl.reproducible=true",
        "validation.val_at_start=false", "validation.val_at_end=false", "logging.tensorboard=false",
        "loss.kl_coef=0.05"]  # a KL term: the resumed run must keep the *initial* policy as its reference


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cmd(out: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "rl_core.launch.cli", "train", "tests/recipes/tiny-addition-loop.yaml",
            f"output_dir={out}", f"run_name={name}", *ARGS]


def _prepare(out: Path, name: str, policy: Path) -> Path:
    shutil.copytree(policy, out / name / "init_policy")
    return out / name


def test_sigkill_then_same_command_resumes_exactly(tmp_path, warm_policy):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    ref = _prepare(tmp_path, "ref", warm_policy)
    subprocess.run(_cmd(tmp_path, "ref"), cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)

    run = _prepare(tmp_path, "killed", warm_policy)
    proc = subprocess.Popen(_cmd(tmp_path, "killed"), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    marker = run / "steps" / "step_000008" / "manifest.json"
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), "the run never wrote its first step checkpoint"
    assert not (run / "final_policy").exists(), "the run finished before it could be killed"

    again = subprocess.run(_cmd(tmp_path, "killed"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "[resume] continuing from" in again.stdout + again.stderr

    assert _sha(run / "final_policy" / "model.safetensors") == _sha(ref / "final_policy" / "model.safetensors")
    a, b = read_jsonl(ref / "metrics.jsonl", "train"), read_jsonl(run / "metrics.jsonl", "train")
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        assert x["train/reward_mean"] == y["train/reward_mean"] and x["train/loss"] == y["train/loss"]
    # the resumed process's own token count (its tokens/s) excludes what the killed one generated
    done = json.loads((run / "summary.json").read_text())
    assert 0 < done["generated_tokens_this_process"] < done["generated_tokens"]


def test_resume_between_ppo_mini_steps(tmp_path, warm_policy):
    """An RL step of 2 epochs x 2 minibatches, checkpointed between its mini-steps, killed, resumed."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    extra = ["grpo.max_num_steps=5", "grpo.ppo_epochs=2", "grpo.num_minibatches=2", "checkpoint.save_every_steps=0",
             "checkpoint.save_every_optimizer_steps=2", "checkpoint.keep_last=4"]

    def cmd(name):
        return [sys.executable, "-m", "rl_core.launch.cli", "train", "tests/recipes/tiny-addition-loop.yaml",
                f"output_dir={tmp_path}", f"run_name={name}", *ARGS, *extra]

    ref = _prepare(tmp_path, "ref", warm_policy)
    subprocess.run(cmd("ref"), cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    run = _prepare(tmp_path, "killed", warm_policy)
    proc = subprocess.Popen(cmd("killed"), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    marker = run / "steps" / "step_000002_opt000010" / "manifest.json"  # RL step 2, before its 3rd mini-step
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists() and not (run / "final_policy").exists()
    again = subprocess.run(cmd("killed"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _sha(run / "final_policy" / "model.safetensors") == _sha(ref / "final_policy" / "model.safetensors")
    a, b = read_jsonl(ref / "metrics.jsonl", "train"), read_jsonl(run / "metrics.jsonl", "train")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5] and b[-1]["train/optimizer_steps_in_rl_step"] == 4
    assert [r["train/loss"] for r in a] == [r["train/loss"] for r in b]
