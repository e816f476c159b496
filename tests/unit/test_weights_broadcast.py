"""Bucketed weight broadcast from a trainer process to a generation process (gloo, 2 real
processes): mixed dtypes and odd sizes survive, tied weights travel once, a real engine is
refitted (its logits equal the sent model's), both sides report bytes and seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rl_core.types import SyncReport
from rl_core.weights.broadcast import BroadcastWeightSync, broadcast_buckets
from tests.helpers.trainers import ROOT, free_port


def test_buckets_keep_order_and_limit():
    assert broadcast_buckets([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert broadcast_buckets([], 8) == []


def test_refit_exports_on_the_device_only_for_a_transport_that_sends_from_it():
    import asyncio

    import torch

    from rl_core.controller.refit import Refitter

    asked = []

    class Trainer:
        def export_weights(self, on_device=False):
            asked.append(on_device)
            return {"w": torch.zeros(2)}

    class Sync:
        def __init__(self, from_device):
            self.sends_from_device = from_device

        async def push(self, version, weights, backends):
            return SyncReport("test", version, 8, 0.0)

    for from_device in (False, True):
        asyncio.run(Refitter([], Trainer(), sync=Sync(from_device)).refit(1))
    assert asked == [False, True]
    assert BroadcastWeightSync("cuda:0").sends_from_device and not BroadcastWeightSync("cpu").sends_from_device


def test_broadcast_to_a_generation_process(tmp_path):
    port = free_port()
    script = ROOT / "tests/unit/weights_broadcast_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), str(tmp_path / f"r{r}.json")],
                              cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-4000:]
    sent = json.loads((tmp_path / "r0.json").read_text())
    got = json.loads((tmp_path / "r1.json").read_text())
    assert got["misc_version"] == 1 and got["misc_equal"]
    assert got["versions"] == [2, 3]
    assert max(got["logit_diffs"]) < 1e-5
    for s, r in zip(sent["reports"], got["reports"]):
        assert s["bytes"] == r["bytes"] > 0 and s["update_s"] > 0 and r["update_s"] > 0
    assert sent["reports"][1]["buckets"] > 3  # ~10 KB buckets: the model went in several
    # tied embeddings travelled once: the model's bytes are those of its distinct tensors (+ alignment)
    import torch  # noqa: F401  (imported late: the subprocesses above did the work)
    from weights_broadcast_worker import model

    distinct = sum(t.numel() * t.element_size() for k, t in model(1).state_dict().items() if k != "lm_head.weight")
    assert distinct <= sent["reports"][1]["bytes"] < distinct + 16 * 64
