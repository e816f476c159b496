"""The asynchronous RL loop with `generation.backend: http`: the controller drives a real
`rl-core serve` process (started by the backend), refits it through versioned weight
directories, validates through it, and stops it at the end. Counted in RL steps."""

from __future__ import annotations

import json
import os

from rl_core.metrics.logger import read_jsonl
from rl_core.weights.filesystem import READY, latest_ready_version, version_dir

STEPS = 4


def test_rl_steps_through_a_local_http_server(run_recipe):
    summary, run_dir = run_recipe(
        "generation.backend=http", "generation.placement=separate", "generation.http.num_local_servers=1",
        "generation.http.server_torch_num_threads=1", "generation.http.health_check_interval_s=1",
        f"grpo.max_num_steps={STEPS}", "validation.val_at_start=false", "validation.max_val_samples=64",
        name="http")
    assert summary["rl_steps"] == STEPS
    assert summary["max_staleness"] <= summary["staleness_bound"]
    # the server served the trained weights: validation at the end ran on version STEPS
    assert summary["val_end"]["weight_version"] == STEPS
    train = read_jsonl(run_dir / "metrics.jsonl", kind="train")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    last = train[-1]
    assert last["generation/servers"] == 1 and last["generation/healthy_servers"] == 1
    assert last["generation/weight_updates"] >= STEPS - 1 and last["generation/infra_errors"] == 0
    assert last["generation/samples"] >= STEPS * 16 * 8
    # single-turn groups go to the server as one request each (n choices, one seed each)
    assert last["generation/group_requests"] == last["generation/requests"] >= STEPS * 16
    # refit went through READY version directories under <run dir>/weights (older ones pruned)
    weights = run_dir / "weights"
    assert latest_ready_version(weights) == STEPS and (version_dir(weights, STEPS) / READY).is_file()
    assert not version_dir(weights, 1).exists()
    # the local server logged to <run dir>/servers and was stopped by the backend
    info = json.loads((run_dir / "servers" / "server0.ready.json").read_text())
    assert (run_dir / "servers" / "server0.log").read_text().startswith("--- launch 1:")
    try:
        os.kill(info["pid"], 0)
        status = open(f"/proc/{info['pid']}/status").read()
        assert "zombie" in status.lower(), "the local server outlived the run"
    except ProcessLookupError:
        pass
