"""Fault injection on the real loop (native engine + torch trainer): generations that raise
(infra and data failures), hang past their deadline, a microbatch that raises once. The run
completes, and the counts of committed, trained, dropped and retried groups add up."""

from __future__ import annotations

import asyncio

import pytest

from rl_core.launch.preflight import load_recipe
from rl_core.controller.controller import Controller
from rl_core.launch.train import build_parts

from tests.helpers.paths import ROOT, TINY_RECIPE as RECIPE  # noqa: F401


def _attempt(request_id: str) -> int:
    return int(request_id.split("/")[1][1:])  # "<group_id>/a<attempt>/<sample>"


def _prompt(request_id: str) -> int:
    return int(request_id.split("-")[1][1:])  # "e<epoch>-p<index>-d<dispatch>/..."


class FaultyBackend:
    """Wraps the real backend; faults are a pure function of (prompt index, attempt, sample)."""

    def __init__(self, inner):
        self.inner = inner
        self.injected = {"infra": set(), "data": set(), "hang": set()}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request):
        p, a, i = _prompt(request.request_id), _attempt(request.request_id), int(request.request_id.rsplit("/", 1)[1])
        if p % 11 == 0 and a == 0 and i == 0:
            self.injected["infra"].add(p)
            raise ConnectionResetError("injected: backend connection reset")
        if p % 13 == 0 and i == 1:
            self.injected["data"].add(p)
            raise ValueError("injected: malformed example")
        if p % 29 == 0 and a == 0 and i == 0:
            self.injected["hang"].add(p)
            await asyncio.sleep(3600)
        return await self.inner.generate(request)


class FlakyTrainer:
    """Wraps the real trainer; the first microbatch of RL step 3 raises once."""

    def __init__(self, inner):
        self.inner = inner
        self.raised = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def version(self):
        return self.inner.version

    def train_microbatches(self, chunk):
        if self.inner.version == 3 and not self.raised:
            self.raised += 1
            raise RuntimeError("injected: CUDA out of memory (simulated)")
        return self.inner.train_microbatches(chunk)


@pytest.mark.parametrize("mode", ["shrink", "replace"])
def test_run_survives_injected_faults(tmp_path, warm_policy, monkeypatch, mode):
    monkeypatch.chdir(ROOT)
    steps = 8
    cfg = load_recipe(RECIPE, [f"output_dir={tmp_path}", "run_name=faults", f"grpo.max_num_steps={steps}",
                               "validation.val_at_start=false", "validation.val_at_end=false",
                               "logging.tensorboard=false", "async_rl.failure.generation_timeout_s=8.0",
                               "async_rl.failure.backoff_base_s=0.01", "async_rl.failure.max_dropped_groups=50",
                               f"async_rl.failure.on_dropped_group={mode}",
                               "async_rl.failure.min_step_batch_fraction=0.5"])
    parts = build_parts(cfg, warm_policy)
    parts.backend = FaultyBackend(parts.backend)
    parts.trainer = FlakyTrainer(parts.trainer)
    ctl = Controller(cfg, parts, tmp_path / "faults", total_steps=steps)
    summary = asyncio.run(ctl.run())

    rs, counts, inj = ctl.rollout.stats, ctl.buffer.counts, parts.backend.injected
    assert summary["rl_steps"] == steps
    assert inj["infra"] and inj["data"] and inj["hang"], inj
    # every infra fault and every deadline miss was retried; data faults (budget 1) were dropped
    assert rs.infra_retries >= len(inj["infra"]) + len(inj["hang"])
    assert rs.dropped_groups == len(inj["data"]) > 0
    trained = ctl.train.trained_group_ids
    assert len(trained) == len(set(trained))
    assert not any(int(g.split("-")[1][1:]) % 13 == 0 for g in trained), "a dropped group was trained"
    # accounting: every dispatched group is trained, dropped (aborted slot) or still ready for later steps
    assert rs.dispatched_groups == counts["selected"] + counts["aborted"] + counts["evicted"] + ctl.buffer.live()
    assert counts["selected"] == len(trained)
    if mode == "shrink":
        assert len(trained) == steps * 16 - sum(v for s, v in ctl.rollout.dropped_per_step.items() if s < steps)
    else:
        assert len(trained) == steps * 16 and rs.replaced_groups == rs.dropped_groups
    assert ctl.train.train_retries == 1 and parts.trainer.raised == 1
