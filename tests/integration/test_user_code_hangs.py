"""User code that blocks, awaits forever or outlives its controller, through a real `rl-core train`
process (CPU, the tiny model without warm-up, small deadlines so each case takes seconds):

- an agent that calls `time.sleep` is named (module, function, file:line) by the watchdog within
  `async_rl.watchdog.block_timeout_s`, and the process exits with status 2;
- an agent that awaits forever misses `env.episode_timeout_s` and the run stops naming it;
- a custom environment whose scoring blocks: with `env_timeout_s` the run stops with its
  `GroupDropped` naming the stuck line and the process exits (its stuck thread is a daemon);
  without it the controller's loop is blocked and the watchdog ends the process naming the line;
- a SIGKILLed run whose `env.command` service was started by rl_core resumes with the same
  command: the service died with its controller (parent-death signal), or, when a wrapper
  left a child behind, the rerun stops it (pid file) and binds the port.
Every process a test starts is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.net import free_port
from tests.helpers.paths import ROOT, TINY_RECIPE as RECIPE
from tests.helpers.processes import finish

COLD = ["model.warmup.enabled=false", "logging.tensorboard=false", "generation.max_tokens=6",
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "validation.max_val_samples=8"]

USER_CODE = '''
import asyncio
import time

from rl_core.envs.base import BaseEnv
from rl_core.types import EnvResult


async def sleepy_agent(client, example, **kwargs):
    time.sleep(3600)
    return 1.0


async def waiting_agent(client, example, **kwargs):
    await asyncio.Event().wait()
    return 1.0


class StuckEnv(BaseEnv):
    name = "stuck"

    def score_completion(self, example, completion):
        time.sleep(3600)
        return EnvResult(reward=0.0)
'''


def _train(tmp_path: Path, name: str, *overrides: str, log: Path | None = None) -> subprocess.Popen:
    """`rl-core train` on the tiny recipe in a session of its own, with the test's user code on
    PYTHONPATH; its console piped, or written to `log`."""
    user = tmp_path / "user_code"
    user.mkdir(exist_ok=True)
    (user / "hang_code.py").write_text(USER_CODE)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(user), str(ROOT), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "rl_core.launch.cli", "train", str(RECIPE), f"output_dir={tmp_path}",
           f"run_name={name}", *COLD, *overrides]
    with open(log, "w") if log is not None else contextlib.nullcontext(subprocess.PIPE) as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[str, float]:
    """The console of `proc` and the seconds it took to exit (killed, by PID, past `timeout`)."""
    t0 = time.monotonic()
    out = finish(proc, timeout)
    return out, time.monotonic() - t0


def _error(console: str) -> str:
    (line,) = [ln for ln in console.splitlines() if ln.startswith(("rl-core train:", "rl-core:"))]
    return line


def test_a_blocking_agent_is_named_within_the_watchdog_deadline(tmp_path):
    proc = _train(tmp_path, "sleepy", "env.type=agent", "env.target=hang_code:sleepy_agent",
                  "async_rl.watchdog.block_timeout_s=3", "grpo.max_num_steps=2")
    console, _ = _finish(proc, 180)
    assert proc.returncode == 2, console
    message = _error(console)
    assert "the event loop of agent hang_code:sleepy_agent" in message, console
    assert f"hang_code.sleepy_agent ({tmp_path / 'user_code' / 'hang_code.py'}:10: `time.sleep(3600)`)" in message
    blocked_s = int(re.search(r"ran no callback for (\d+)s", message).group(1))
    assert 3 <= blocked_s <= 5  # named within the deadline (checked twice a second; slack for a loaded machine)
    assert "Traceback" not in console


def test_an_agent_that_awaits_forever_stops_at_its_episode_deadline(tmp_path):
    proc = _train(tmp_path, "waiting", "env.type=agent", "env.target=hang_code:waiting_agent",
                  "env.episode_timeout_s=2", "async_rl.failure.infra_retry_budget_s=3", "grpo.max_num_steps=2")
    console, _ = _finish(proc, 180)
    assert proc.returncode == 2, console
    message = _error(console)
    where = f"hang_code.waiting_agent ({tmp_path / 'user_code' / 'hang_code.py'}:15: `await asyncio.Event().wait()`)"
    assert re.search(r"TimeoutError: agent episode \S+ missed its 2s deadline \(it is stuck at "
                     + re.escape(where) + r"\)\. The run stops: the group of held-out example", message), message
    assert f"Fix: make your code at {where} finish within its deadline" in message
    assert "[retry] validation start: infra failure" in console


@pytest.mark.parametrize("deadline", [True, False], ids=["env_timeout_s", "on_the_loop"])
def test_a_stuck_environment_ends_the_process_with_its_error(tmp_path, deadline):
    overrides = ["async_rl.failure.env_timeout_s=2", "async_rl.failure.infra_retry_budget_s=3"] if deadline else \
        ["async_rl.watchdog.block_timeout_s=2", "async_rl.watchdog.interval_s=1", "async_rl.watchdog.stall_timeout_s=5"]
    proc = _train(tmp_path, "stuck", "env.type=custom", "env.target=hang_code:StuckEnv", "grpo.max_num_steps=2",
                  "validation.val_at_start=false", *overrides)
    console, wall_s = _finish(proc, 180)
    assert proc.returncode == 2, console
    message = _error(console)
    where = f"hang_code.score_completion ({tmp_path / 'user_code' / 'hang_code.py'}:23: `time.sleep(3600)`)"
    assert where in message, message
    if deadline:  # the group's retries ran out: GroupDropped, and the stuck scoring thread did not hold the exit
        assert "environment stuck scoring missed its 2s deadline" in message and "The run stops" in message
        assert f"Fix: make your code at {where} finish within its deadline" in message
        assert message.startswith("rl-core train: TimeoutError")
    else:  # the controller's own loop is blocked: a warning, then at stall_timeout_s the watchdog ends the process
        assert re.match(r"rl-core: the controller's event loop ran no callback for [3-6]s", message), message
        assert "async_rl.failure.env_timeout_s" in message  # the fix
        warning = [ln for ln in console.splitlines() if ln.startswith("[watchdog] the controller's event loop")]
        assert len(warning) == 1 and where in warning[0] and "ran no callback for 2s" in warning[0], console
    assert wall_s < 120, f"the process took {wall_s:.0f}s to exit"


# ---------------------------------------------------------------------------- env.command and SIGKILL


@pytest.mark.parametrize("wrapped", [False, True], ids=["service", "service_under_a_shell"])
def test_a_sigkilled_http_env_run_resumes_with_the_same_command(tmp_path, wrapped):
    from rl_core.envs.service import pid_file, session_members

    port, steps = free_port(), 3
    service = [sys.executable, str(ROOT / "examples" / "agents" / "env_service.py"), "--port", str(port)]
    # a shell that runs the service as its child (no exec): the parent-death signal ends the shell
    # only, its child would keep the port; the rerun's pid-file cleanup must stop it
    command = ["sh", "-c", " ".join(service) + "; exit 0"] if wrapped else service
    url = f"http://127.0.0.1:{port}"
    args = ["env.type=http", f"env.url={url}", f"env.command={json.dumps(command)}", "env.reward_names=[turn1,turn2]",
            f"grpo.max_num_steps={steps}", "checkpoint.save_every_steps=1", "validation.val_at_start=false",
            "validation.val_at_end=false"]
    record_path, seen, record = pid_file(url), [], None
    log = tmp_path / "first.log"  # a file, not a pipe: the killed run's console is not read to its end
    first = _train(tmp_path, "http-kill", *args, log=log)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "http-kill" / "steps" / "step_000001").is_dir():
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        record = json.loads(record_path.read_text())
        seen = session_members(record)
        assert record["pid"] in seen and len(seen) == (2 if wrapped else 1), (record, seen)
        os.kill(first.pid, signal.SIGKILL)  # the controller only: its service is in a session of its own
        first.wait()
        time.sleep(2.0)
        left = session_members(record)
        if wrapped:  # the shell died with its controller; its child (the service) is left behind
            assert record["pid"] not in left and len(left) == 1, left
        else:
            assert left == [], f"the service outlived its controller: {left}"
        rerun = _train(tmp_path, "http-kill", *args)
        console, _ = _finish(rerun, 300)
        assert rerun.returncode == 0, console
        assert "[resume] continuing from" in console
        assert ("[env] stopping the environment service a killed run left" in console) == wrapped, console
        summary = json.loads((tmp_path / "http-kill" / "summary.json").read_text())
        assert summary["rl_steps"] == steps
        assert session_members(record) == [] and not record_path.exists()  # the rerun stopped its own service too
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
        for pid in seen:  # the services this test's runs started, by PID, if anything left them running
            if record is not None and pid in session_members(record):
                os.kill(pid, signal.SIGKILL)
