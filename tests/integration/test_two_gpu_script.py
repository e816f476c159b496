"""bench/two_gpu.py on the CPU (gloo, two processes, tiny shapes): the script the two-GPU run uses,
end to end. Part 1 is the real controller with the fsdp2 trainer and an `rl-core serve` process,
refitted by broadcast after every RL step; part 2 is the fsdp2 step on 1 and on 2 processes.
Counted in RL steps; the numbers are checked for being present and consistent, never for speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def test_two_gpu_script_on_cpu(tmp_path):
    out = tmp_path / "two_gpu.json"
    env = {k: v for k, v in os.environ.items() if k not in NO_MULTICAST and k != "OUT"}
    proc = subprocess.run([sys.executable, "bench/two_gpu.py", "--device", "cpu", "--steps", str(STEPS),
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "scaling efficiency" in proc.stdout and "refit every step: True" in proc.stdout
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and "error" not in res
    # multicast off in the script's own environment and in its children
    assert res["env"] == NO_MULTICAST and res["bandwidth"]["env"] == NO_MULTICAST
    assert res["bandwidth"]["d2d_gb_s"] > 0

    p1 = res["part1"]
    assert "failed" not in p1 and "skipped" not in p1
    assert p1["summary"]["rl_steps"] == STEPS and p1["summary"]["max_staleness"] <= 1
    # a broadcast refit after every RL step, carrying the whole model (fp32, tensors 16-byte aligned)
    assert p1["refit_every_step"] is True
    assert [r["step"] for r in p1["refit_per_step"]] == list(range(1, STEPS + 1))
    model_bytes = 4 * p1["num_parameters"]
    for r in p1["refit_per_step"]:
        assert model_bytes <= r["bytes"] < model_bytes + 16 * 64
        assert r["sync_broadcast_s"] > 0 and r["sync_recv_s"] > 0 and r["update_s"] >= r["sync_broadcast_s"]
    assert p1["refit_per_step"][0]["sync_group_init_s"] > 0  # the group forms at the first refit only
    assert all(r["sync_group_init_s"] == 0 for r in p1["refit_per_step"][1:])
    f = p1["refit"]
    assert f["update_gb_s"] > 0 and f["broadcast_gb_s"] > 0 and 0 < f["broadcast_frac_of_d2d"]
    idle = p1["idle"]
    assert idle["window_s"] > 0 and idle["generation_busy_s"] > 0 and idle["train_busy_s"] > 0
    for k in ("generation_idle_frac", "train_idle_frac", "trainer_side_idle_frac", "overlap_frac"):
        assert 0 <= idle[k] < 1, (k, idle[k])
    assert idle["trainer_side_idle_frac"] <= idle["train_idle_frac"]

    p2 = res["part2"]
    w1, w2 = p2["runs"]["world1"], p2["runs"]["world2"]
    assert (w1["world_size"], w2["world_size"]) == (1, 2)
    assert w2["env"] == NO_MULTICAST
    for w in (w1, w2):
        assert w["step_s"] > 0 and w["tokens_per_s"] > 0 and len(w["steps_s"]) >= 2
    # the same step on the same batch: 2 processes give the 1-process loss
    assert abs(w1["loss"] - w2["loss"]) <= 1e-5 * max(1.0, abs(w1["loss"]))
    assert p2["scaling_efficiency"] == w1["step_s"] / (2 * w2["step_s"]) > 0
