"""Runtime failures as a user meets them, through a real `rl-core train` process (CPU, the
tiny model without warm-up, counted in RL steps):

- an agent that raises, and one that never calls the model: the console says so in a few
  lines naming the agent (`env.target`), the example and the user's file:line; the full
  traceback is in <run dir>/logs/train.log only;
- an HTTP environment service (a real local process, examples/agents/env_service.py) stopped
  for 5 s mid-validation and, in another run, mid-training: under the default retry budget
  (`async_rl.failure`) the run finishes, no group is lost (every held-out prompt validated,
  every step trains all its groups, the rollouts archive holds them) and the console shows
  the retries.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.helpers.net import free_port
from tests.helpers.paths import ROOT, TINY_RECIPE as RECIPE
from tests.helpers.processes import finish

COLD = ["model.warmup.enabled=false", "logging.tensorboard=false", "generation.max_tokens=6"]
PROMPTS, SAMPLES = 4, 4  # per RL step

AGENTS = '''
async def raising_agent(client, example, **kwargs):
    digits = int(example["answer"])
    return digits / 0


async def silent_agent(client, example, **kwargs):
    return 1.0
'''

# the example service, printing a line per finished episode; given a count, it exits right after
# answering that many episodes, as a killed service does: the episodes in flight are cut off
SERVICE = '''
import os
import sys
import threading

sys.path.insert(0, {root!r})
from examples.agents.env_service import Handler, make_server

DIE_AFTER = int(sys.argv[2]) if len(sys.argv) > 2 else 0
lock, answered = threading.Lock(), [0]


class Counting(Handler):
    def do_POST(self):
        super().do_POST()
        with lock:
            answered[0] += 1
            print("episode", flush=True)
            if answered[0] == DIE_AFTER:
                os._exit(1)


make_server(int(sys.argv[1]), Counting).serve_forever()
'''


def _train(tmp_path: Path, name: str, *overrides: str, pythonpath: str = "") -> subprocess.Popen:
    """`rl-core train` on the tiny recipe in a process of its own, its console (stdout and stderr) piped."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (pythonpath, str(ROOT), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "rl_core.launch.cli", "train", str(RECIPE), f"output_dir={tmp_path}",
           f"run_name={name}", *COLD, *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _agent_failure(tmp_path: Path, agent: str) -> tuple[str, str]:
    """`rl-core train` with a failing agent: it stops with exit status 2 and at most 15 console
    lines, no traceback among them; returns (the error's line, the run's log file's text)."""
    user = tmp_path / "user_code"
    user.mkdir()
    (user / "my_agents.py").write_text(AGENTS)
    proc = _train(tmp_path, agent, "env.type=agent", f"env.target=my_agents:{agent}", "grpo.max_num_steps=3",
                  f"grpo.num_prompts_per_step={PROMPTS}", f"grpo.num_generations_per_prompt={SAMPLES}",
                  "validation.max_val_samples=8", pythonpath=str(user))
    lines = finish(proc).splitlines()
    console = "\n".join(lines)
    assert proc.returncode == 2, console
    assert len(lines) <= 15 and "Traceback" not in console, console
    (message,) = [line for line in lines if line.startswith("rl-core train:")]
    log = tmp_path / agent / "logs" / "train.log"
    assert message.endswith(f"(full traceback: {log})")
    return message, log.read_text()


def test_an_agent_that_raises_is_one_paragraph_naming_it(tmp_path):
    message, log = _agent_failure(tmp_path, "raising_agent")
    assert "agent my_agents:raising_agent raised ZeroDivisionError" in message
    assert f"{tmp_path / 'user_code' / 'my_agents.py'}:4 in raising_agent" in message  # the user's frame
    assert re.search(r"held-out example \d+ in validation 'start' \(weight version 0\) \{'id': ", message)  # the example
    assert "Traceback" in log and "return digits / 0" in log


def test_an_agent_that_never_calls_the_model_is_named(tmp_path):
    message, log = _agent_failure(tmp_path, "silent_agent")
    assert "agent my_agents:silent_agent returned 1.0 without calling the model" in message
    assert "episode" not in message.split(" without calling the model")[0]  # the agent is named, not the episode
    assert "Traceback" in log


# ---------------------------------------------------------------------------- an HTTP service down for 5 s


class Service:
    """The example environment service as a real local process on `port` (exiting by itself
    after `die_after` episodes when that is set); `down_for(5)` stops it (kills it, unless it
    exited already) and starts it again on the same port 5 s later. Every process is stopped
    by its PID."""

    def __init__(self, tmp_path: Path, die_after: int = 0):
        self.port = free_port()
        self.script = tmp_path / "counting_service.py"
        self.script.write_text(SERVICE.format(root=str(ROOT)))
        self.procs: list[subprocess.Popen] = []
        self.episodes = 0  # episodes the service answered (all its processes)
        self.down: tuple[float, float] | None = None  # (stopped, answering again) in time.monotonic()
        self.start(die_after)

    def start(self, die_after: int = 0) -> None:
        with open(self.script.with_suffix(".log"), "a") as log:  # its own tracebacks (episodes cut short)
            proc = subprocess.Popen([sys.executable, str(self.script), str(self.port), str(die_after)],
                                    stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        self.procs.append(proc)
        threading.Thread(target=self._count, args=(proc,), daemon=True).start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the environment service did not start")

    def _count(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.episodes += line.strip() == "episode"

    def exited(self) -> bool:
        return self.procs[-1].poll() is not None

    def down_for(self, seconds: float) -> None:
        t0 = time.monotonic()
        if not self.exited():
            os.killpg(self.procs[-1].pid, signal.SIGKILL)
        self.procs[-1].wait()
        time.sleep(seconds)
        self.start()
        self.down = (t0, time.monotonic())

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(10)


def _run_with_outage(tmp_path: Path, name: str, when, steps: int, *overrides: str, die_after: int = 0):
    """`rl-core train` against the service, which is down for 5 s from when `when(service, run dir)`
    holds; returns (exit status, console lines, run dir, service)."""
    service = Service(tmp_path, die_after)
    run = tmp_path / name
    done = threading.Event()

    def chaos():
        while not done.is_set():
            if when(service, run):
                service.down_for(5.0)
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=chaos, daemon=True)
    try:
        proc = _train(tmp_path, name, "env.type=http", f"env.url=http://127.0.0.1:{service.port}",
                      "env.reward_names=[turn1,turn2]", f"grpo.max_num_steps={steps}",
                      f"grpo.num_prompts_per_step={PROMPTS}", f"grpo.num_generations_per_prompt={SAMPLES}",
                      "validation.val_at_end=false", *overrides)
        watcher.start()
        out = finish(proc)
        done.set()
        watcher.join(30)
    finally:
        done.set()
        service.close()
    assert service.down is not None and service.down[1] - service.down[0] >= 5.0, "the service was never stopped"
    return proc.returncode, out.splitlines(), run, service


def _groups_in_archive(run: Path) -> list[str]:
    """The group ids in the rollouts archive `rl-core train` wrote (and `rl-core inspect` reads)."""
    from rl_core.archive import RolloutArchive, inspect_main

    assert "samples (first 2 of the archive" in inspect_main(str(run / "rollouts.h5"), num_samples=2)
    with RolloutArchive(run / "rollouts.h5") as ar:
        return [g.decode() for g in ar.column("groups/group_id")]


def test_an_http_service_down_for_5_s_mid_validation_loses_nothing(tmp_path):
    val = 16  # episodes of the validation at start, all sent at once; the service exits after answering 4
    rc, lines, run, service = _run_with_outage(tmp_path, "down-in-val", lambda s, _run: s.exited(), 2,
                                               f"validation.max_val_samples={val}", die_after=val // 4)
    console = "\n".join(lines)
    assert rc == 0, console
    summary = json.loads((run / "summary.json").read_text())
    (start,) = summary["validations"]
    assert start["label"] == "start" and start["num_prompts"] == val and start["dropped_prompts"] == 0
    assert start["infra_retries"] > 0  # the outage fell in the validation, which retried
    assert any(line.startswith("[retry] validation start: infra failure") for line in lines), console
    assert summary["rl_steps"] == 2
    assert len(_groups_in_archive(run)) == 2 * PROMPTS


def test_an_http_service_down_for_5_s_mid_training_loses_nothing(tmp_path):
    steps = 6

    def two_steps_trained(_service, run: Path) -> bool:
        metrics = run / "metrics.jsonl"
        return metrics.is_file() and metrics.read_text().count('"kind": "train"') >= 2

    rc, lines, run, service = _run_with_outage(tmp_path, "down-in-train", two_steps_trained, steps,
                                               "validation.val_at_start=false")
    console = "\n".join(lines)
    assert rc == 0, console
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rl_steps"] == steps
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["train/num_groups"] for r in train] == [PROMPTS] * steps  # every step trained all its groups
    assert train[-1]["rollout/dropped_groups"] == 0
    assert sum(r["failures/infra_retries"] for r in train) > 0
    groups = _groups_in_archive(run)
    assert len(groups) == len(set(groups)) == steps * PROMPTS  # none lost, none trained twice
    assert any(line.startswith("[retry] training: infra failure") for line in lines), console
