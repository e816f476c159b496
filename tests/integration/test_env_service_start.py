"""`env.command` on the real loop: rl_core starts the environment service before the model
loads (its boot overlaps the generation and trainer set-up), waits for `GET /health` before the
first episode, trains through it, and stops it by the PID it recorded. Asserted from what the
processes and files show at each point, never from a timing threshold."""

from __future__ import annotations

import json
import os
import signal
import sys

from rl_core.metrics.logger import read_jsonl
from tests.helpers.net import free_port, listening
from tests.helpers.paths import ROOT


def test_env_command_starts_before_the_model_loads_and_stops_by_pid(run_recipe, monkeypatch):
    import rl_core.launch.placement as placement
    from rl_core.envs.service import pid_file, session_members

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, str(ROOT / "examples" / "agents" / "env_service.py"), "--port", str(port)]
    seen: dict = {}
    build = placement.build_overlapped

    def spy(*args, **kwargs):  # the real set-up, observed as it begins and as it ends
        seen["record"] = json.loads(pid_file(url).read_text())
        seen["alive_at_setup_start"] = session_members(seen["record"])
        out = build(*args, **kwargs)
        seen["alive_at_setup_end"] = session_members(seen["record"])
        return out

    monkeypatch.setattr(placement, "build_overlapped", spy)
    assert not listening(port)
    try:
        summary, run_dir = run_recipe("env.type=http", f"env.url={url}", f"env.command={json.dumps(command)}",
                                      "env.reward_names=[turn1,turn2]", "generation.max_tokens=6",
                                      "grpo.max_num_steps=2", "validation.val_at_start=false",
                                      "validation.val_at_end=false", name="env-command")
    finally:  # whatever happened: stop what the run started, by the PIDs it recorded
        for pid in session_members(seen["record"]) if "record" in seen else []:
            os.kill(pid, signal.SIGKILL)
    record = seen["record"]
    # started by rl_core before the set-up began: its boot overlaps the model loads
    assert record["command"] == command and record["url"] == url
    assert record["pid"] in seen["alive_at_setup_start"] and record["pid"] in seen["alive_at_setup_end"]
    # the episodes went through it (health was waited for: no episode failed), then it was stopped
    assert summary["rl_steps"] == 2
    recs = read_jsonl(run_dir / "metrics.jsonl", kind="train")
    assert all("reward/turn1" in r and "reward/turn2" in r for r in recs), recs[-1].keys()
    assert recs[-1]["failures/infra_retries"] == 0
    assert session_members(record) == [] and not pid_file(url).exists() and not listening(port)
