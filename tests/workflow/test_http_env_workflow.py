"""A workflow run whose environment is an HTTP service rl_core starts and stops (`env.type: http`
with `env.command`): the train rule's controller launches examples/agents/env_service.py,
every episode of the epoch goes through it, and when the rule ends the service is gone, its
port free and its PID record removed. Starts from the reference run's initial policy."""

from __future__ import annotations

import json
import sys

from rl_core.metrics.logger import read_jsonl
from tests.helpers.net import free_port, listening
from tests.helpers.workflow import ROOT, hf_overrides, job_stats, make_workdir, short_config, snakemake


def test_http_env_service_started_and_stopped_by_the_train_rule(reference_run, tmp_path):
    from rl_core.envs.service import pid_file

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, str(ROOT / "examples" / "agents" / "env_service.py"), "--port", str(port)]
    overrides = [*hf_overrides(reference_run), "env.type=http", f"env.url={url}", f"env.command={json.dumps(command)}",
                 "env.reward_names=[turn1,turn2]", "generation.max_tokens=6", "async_rl.reproducible=false"]
    wd = make_workdir(tmp_path / "wd")
    args = ["--cores", "2", "results/http-env/epoch_1/checkpoint", *short_config("http-env", overrides)]
    assert not listening(port)
    out = snakemake(wd, *args)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert job_stats(out.stderr).get("train_epoch") == 1
    epoch = wd / "results" / "http-env" / "epoch_1"
    recs = read_jsonl(epoch / "metrics.jsonl", kind="train")
    assert len(recs) == 6 and all("reward/turn1" in r and "reward/turn2" in r for r in recs)  # scored by the service
    assert recs[-1]["failures/infra_retries"] == 0
    resolved = json.loads((epoch / "checkpoint" / "resolved_config.json").read_text())
    assert resolved["env"]["command"] == command
    assert not listening(port) and not pid_file(url).exists()  # stopped with its rule, its record removed
