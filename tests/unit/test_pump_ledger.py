"""The pumps meet only at the buffer, the version clock and the `PumpLedger` (issue 40, "Pumps"):
the train pump and the refitter hold no reference to the rollout pump (checked on the source,
and shown to catch a planted one); what the train pump asks of the rollout pump goes through
the ledger and is served (stale aborts after a refit, refills after the rollout pump's own
dispatch ended); the sampler declares the lookahead and the capacity the controller sizes
from, each derived once; a custom sampler's capacity rule is enforced by the controller."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from rl_core.controller.controller import Controller
from rl_core.errors import RecipeError
from rl_core.samplers import make_sampler
from rl_core.samplers.base import BaseSampler
from tests.helpers.fakes import FakeBackend, make_parts
from tests.helpers.recipes import controller_recipe, recipe

CONTROLLER = Path(__file__).resolve().parents[2] / "rl_core" / "controller"


def rollout_pump_references(source: str) -> list[int]:
    """Lines of `source` that name the rollout pump object: its module or class, a `rollout`
    attribute, variable or parameter."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("rollout_pump"):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr in ("rollout", "RolloutPump"):
            lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id in ("rollout", "RolloutPump"):
            lines.append(node.lineno)
        elif isinstance(node, ast.arg) and node.arg == "rollout":
            lines.append(node.lineno)
    return lines


def test_the_train_pump_and_the_refitter_hold_no_reference_to_the_rollout_pump():
    for name in ("train_pump.py", "refit.py", "step_metrics.py"):
        assert rollout_pump_references((CONTROLLER / name).read_text()) == [], name
    planted = "class P:\n    def f(self, rollout):\n        self.rollout.restamp('g', 1)\n"
    assert rollout_pump_references(planted) == [2, 3]


class HoldBackend(FakeBackend):
    """Holds the samples of the groups with the given dispatch indices until they are cancelled."""

    def __init__(self, hold: set[int]):
        super().__init__(seed=2, max_latency_s=0.002)
        self.hold, self.cancelled = hold, set()

    async def generate(self, request):
        d = int(request.request_id.split("/")[0].rsplit("-d", 1)[1])
        if d in self.hold:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.add(d)
                raise
        return await super().generate(request)


def test_stale_in_flight_groups_are_aborted_at_the_train_pumps_request(tmp_path):
    # windowed, window 0: a group still generating when the trainer's version passes its own is
    # stale; the train pump asks (ledger) and the rollout pump cancels it before the step's metrics
    cfg = controller_recipe(async_rl={"sampler": {"type": "windowed", "max_staleness_versions": 0}})
    backend = HoldBackend({1, 6})
    ctl = Controller(cfg, make_parts(cfg, backend=backend), tmp_path, total_steps=6)
    records = []
    ctl.step_observers.append(records.append)
    summary = asyncio.run(asyncio.wait_for(ctl.run(), 60))
    assert summary["rl_steps"] == 6 and backend.cancelled == {1, 6}
    aborted = [r.metrics["rollout/aborted_stale_inflight_groups"] for r in records]
    assert aborted == sorted(aborted) and aborted[-1] == ctl.ledger.stale_aborted_groups >= 2
    assert ctl.train.stale_aborted_groups == ctl.rollout.stats.aborted_groups == ctl.ledger.stale_aborted_groups
    assert records[-1].metrics["rollout/wasted_samples"] == ctl.ledger.wasted_samples >= 2 * 2
    assert not {int(g.rsplit("-d", 1)[1]) for g in ctl.train.trained_group_ids} & {1, 6}


def test_the_rollout_pump_serves_refills_after_its_own_dispatch_ended(tmp_path):
    # one step of in_order: the rollout pump dispatches the step's 4 groups, they finish, its
    # dispatch has ended (`exhausted`); a refill asked for then (dynamic sampling set a group of
    # the step aside) is still dispatched, past the admission gate, for that step
    cfg = controller_recipe(grpo={"max_num_steps": 1})
    ctl = Controller(cfg, make_parts(cfg), tmp_path, total_steps=1)
    ctl.setup()
    ledger, buffer, pump = ctl.ledger, ctl.buffer, ctl.rollout

    async def main():
        task = asyncio.create_task(pump.run())
        await buffer.wait_for(lambda: ledger.exhausted, timeout=20)
        assert buffer.num_ready() == 4 and ledger.inflight == 0 and not task.done()
        ledger.refills.append(0)
        await buffer.notify()
        assert await buffer.wait_for(lambda: buffer.num_ready() == 5, timeout=20)
        await pump.stop()
        await asyncio.wait_for(task, 20)

    asyncio.run(main())
    assert pump.stats.refill_groups == 1 and pump.stats.dispatched_groups == 5 and not ledger.refills
    assert sorted(s.target_step for s in buffer.ready()) == [0] * 5
    assert pump.waiting_on == "done"


def test_dynamic_sampling_refills_every_set_aside_group(tmp_path):
    cfg = controller_recipe(grpo={"num_generations_per_prompt": 4},
                            reward_shaping={"dynamic_sampling": {"enabled": True,
                                                                 "max_num_dropped_groups_per_step": 64}})
    ctl = Controller(cfg, make_parts(cfg, num_examples=400), tmp_path, total_steps=6)
    records = []
    ctl.step_observers.append(records.append)
    summary = asyncio.run(asyncio.wait_for(ctl.run(), 60))
    assert summary["rl_steps"] == 6 and [len(r.trained) for r in records] == [4] * 6
    filtered = ctl.train.dynamic_filtered_groups
    assert filtered > 0 and ctl.rollout.stats.refill_groups == filtered
    assert records[-1].metrics["rollout/dynamic_filtered_groups"] == filtered
    assert ctl.ledger.train_stats.wasted_samples == 4 * filtered and not ctl.ledger.refills


def test_the_sampler_declares_its_lookahead_and_capacity_once():
    adaptive = {"type": "in_order", "max_lookahead_versions": 1,
                "adaptive": {"enabled": True, "min_lookahead_versions": 0, "max_lookahead_versions": 3}}
    cases = [({"type": "in_order", "max_lookahead_versions": 2}, False, 2, 4),
             ({"type": "in_order", "max_lookahead_versions": 2}, True, 2, 12),
             (adaptive, True, 3, 16),
             ({"type": "windowed", "max_staleness_versions": 2}, False, 0, 4),
             ({"type": "weight_fifo", "max_staleness_versions": 2}, False, 0, 4)]
    for scfg, reproducible, lookahead, capacity in cases:
        cfg = recipe(grpo={"num_prompts_per_step": 4},
                     async_rl={"sampler": scfg, "reproducible": reproducible, "max_buffered_groups": 16})
        s = make_sampler(cfg)
        assert (s.lookahead, s.required_capacity()) == (lookahead, capacity), scfg
        if scfg["type"] == "in_order":
            assert s.lookahead == cfg.async_rl.sampler.largest_lookahead()
            assert capacity == cfg.async_rl.sampler.required_capacity(4, reproducible)


class GreedySampler(BaseSampler):
    """A custom sampler that needs more buffer slots than the recipe gives."""

    name = "greedy"

    def select(self, buffer, trainer_version, max_groups):
        return buffer.ready()[:max_groups]

    def required_capacity(self) -> int:
        return 100


def test_the_controller_refuses_a_buffer_smaller_than_the_samplers_capacity_rule(tmp_path):
    cfg = controller_recipe(async_rl={"max_buffered_groups": 64})
    parts = make_parts(cfg)
    parts.sampler = GreedySampler(4, None)
    with pytest.raises(RecipeError, match=r"async_rl.max_buffered_groups.*>= 100"):
        Controller(cfg, parts, tmp_path, total_steps=6).setup()
