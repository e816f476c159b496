"""Packaging: rl_core as a user installs it, from a built wheel into a fresh venv.

Builds the wheel of this checkout (`pip wheel`, no dependencies), creates a new venv with
the base interpreter, installs the wheel with the pinned constraints.txt, and then, from a
directory outside the clone (so nothing is imported from the source tree): `pip check`,
`rl-core validate`, a one-step `rl-core train` (initial policy included), `rl-core
serve` of the trained policy answering an OpenAI-style completion, and `rl-core new` with a
run of the workflow it wrote (the venv's snakemake, the short recipe cut to a few steps).
The server is started by this test and stopped by its PID."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# the venv's programs import the installed wheel only: no PYTHONPATH pointing into a checkout
_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run(cmd: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_ENV)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_validates_trains_and_serves(tmp_path):
    base_python = getattr(sys, "_base_executable", None) or shutil.which("python3")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
          str(ROOT)], cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("rl_core-*.whl")

    venv = tmp_path / "venv"
    _run([base_python, "-m", "venv", str(venv)], cwd=tmp_path)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    _run([*pip, "install", "-q", "-c", str(ROOT / "constraints.txt"), str(wheel)], cwd=tmp_path, timeout=1200)
    _run([*pip, "check"], cwd=tmp_path)

    # a user's directory: their recipe and data, not the clone
    user = tmp_path / "user"
    user.mkdir()
    shutil.copytree(ROOT / "recipes", user / "recipes")
    shutil.copytree(ROOT / "data", user / "data")
    rl_core = str(venv / "bin" / "rl-core")
    where = _run([str(venv / "bin" / "python"), "-c", "import rl_core; print(rl_core.__file__)"], cwd=user).stdout
    assert str(venv) in where and str(ROOT) not in where, where

    args = ["recipes/tiny-addition.yaml", f"output_dir={user / 'results'}", "grpo.max_num_steps=1",
            "validation.val_at_start=false", "validation.val_at_end=false", "logging.tensorboard=false"]
    out = _run([rl_core, "validate", *args], cwd=user)
    assert "recipe OK" in out.stdout
    _run([rl_core, "train", *args], cwd=user)
    run = user / "results" / "tiny-addition"
    assert json.loads((run / "summary.json").read_text())["rl_steps"] == 1
    policy = run / "final_policy"
    assert (policy / "model.safetensors").is_file()

    ready = tmp_path / "ready.json"
    server = subprocess.Popen([rl_core, "serve", str(policy), "--port", "0", "--ready-file", str(ready)], cwd=user,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env=_ENV)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), f"serve never became ready:\n{server.stderr.read()[-3000:] if server.poll() is not None else ''}"
        info = json.loads(ready.read_text())
        url = info.get("url") or f"http://127.0.0.1:{info['port']}"
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
            models = json.loads(r.read())
        model = models["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "1+2=", "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            done = json.loads(r.read())
        assert done["choices"][0]["text"] is not None and done["usage"]["completion_tokens"] >= 1
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()

    # `rl-core new`: a workflow project from the installed package alone (no clone), then its workflow
    _run([rl_core, "new", "proj"], cwd=user)
    proj = user / "proj"
    for name in ("Snakefile", "workflow/rules/train.smk", "profiles/slurm/config.yaml", "config/config.yaml",
                 "recipes/tiny-addition-short.yaml", "data/addition/train.jsonl"):
        assert (proj / name).is_file(), name
    assert (proj / "Snakefile").read_bytes() == (ROOT / "Snakefile").read_bytes()  # the repository's, packaged
    short = ["model.warmup.enabled=false", "grpo.max_num_steps=2", "grpo.max_num_epochs=1", "data.max_train_examples=16",
             "validation.max_val_samples=8", "evaluation.max_samples=8", "evaluation.num_generations_per_prompt=2"]
    wf = _run([str(venv / "bin" / "snakemake"), "--cores", "2", "--config", "recipe=recipes/tiny-addition-short.yaml",
               "run=short", "overrides=" + json.dumps(short)], cwd=proj, timeout=1800)
    out = wf.stdout + wf.stderr
    assert "held-out accuracy:" in out and "report: results/short/report.html" in out, out[-3000:]
    r = proj / "results" / "short"
    assert json.loads((r / "epoch_1" / "summary.json").read_text())["end_step"] == 2
    assert (r / "epoch_1" / "rollouts.h5").is_file() and (r / "evaluation.json").is_file()
    page = (r / "report.html").read_text()
    assert "recipes/tiny-addition-short.yaml" in page and "grpo.max_num_steps=2" in page  # the recipe, its overrides
    again = _run([str(venv / "bin" / "snakemake"), "-n", "--cores", "2", "--config",
                  "recipe=recipes/tiny-addition-short.yaml", "run=short", "overrides=" + json.dumps(short)], cwd=proj)
    assert "Nothing to be done" in again.stdout + again.stderr
