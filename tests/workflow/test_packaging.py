"""Packaging: rl_core as a user installs it, from a built wheel into a fresh venv.

Builds the wheel of this checkout (`pip wheel`, no dependencies), creates a new venv with
the base interpreter, installs the wheel with the pinned constraints.txt, and then, from a
directory outside the clone (so nothing is imported from the source tree): `pip check`,
`rl-core validate`, a one-step `rl-core train` (initial policy included), and `rl-core
serve` of the trained policy answering an OpenAI-style completion. The server is started
by this test and stopped by its PID."""

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


def _run(cmd: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
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
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
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
