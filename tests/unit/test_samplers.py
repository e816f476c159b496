"""Admit / select / evict / abort semantics of every sampler, one at a time."""

import asyncio
import sys
import types

import pytest

from rl_core.buffer.replay_buffer import ReplayBuffer
from rl_core.config import validate_dict
from rl_core.errors import RecipeError
from rl_core.samplers import make_sampler
from rl_core.types import PromptGroup

from tests.helpers.recipes import recipe


def _cfg(sampler: dict, p: int = 2, **extra):
    return recipe(grpo={"num_prompts_per_step": p}, async_rl={"sampler": sampler, **extra})


def _group(gid, v):
    return PromptGroup(gid, 0, 0, {}, [], v, v)


async def _fill(buf, sampler, versions_and_ready):
    """Dispatch one group per (start_version, ready?) pair; commit the ready ones."""
    for i, (v, ready) in enumerate(versions_and_ready):
        t = sampler.admit(v)
        buf.reserve(f"g{i}", i, i, 0, v, t)
        if ready:
            await buf.commit(f"g{i}", _group(f"g{i}", v))


def test_gates_of_gated_samplers():
    for typ, key in (("in_order", "max_lookahead_versions"), ("weight_fifo", "max_staleness_versions"),
                     ("ready_first", "max_staleness_versions")):
        s = make_sampler(_cfg({"type": typ, key: 1}))
        assert [s.can_admit(0) and s.admit(0) is not None or s.name != "in_order" for _ in range(4)]
        assert s.dispatched == 4 and not s.can_admit(0) and s.can_admit(1), typ


def test_windowed_has_no_gate_and_aborts_out_of_window():
    s = make_sampler(_cfg({"type": "windowed", "max_staleness_versions": 1}))
    for _ in range(100):
        assert s.admit(0) is None
    from rl_core.buffer.replay_buffer import Slot

    assert s.should_abort_inflight(Slot("g", 0, 0, 0, start_version=3, target_step=None), trainer_version=5)
    assert not s.should_abort_inflight(Slot("g", 0, 0, 0, start_version=4, target_step=None), trainer_version=5)


def test_weight_fifo_takes_oldest_version_and_waits_for_its_stragglers():
    async def main():
        buf = ReplayBuffer(16)
        s = make_sampler(_cfg({"type": "weight_fifo", "max_staleness_versions": 2}))
        # versions: g0 v0 (still generating), g1 v0 ready, g2 v1 ready
        await _fill(buf, s, [(0, False), (0, True), (1, True)])
        assert [x.group_id for x in s.select(buf, 1, 10)] == ["g1"]  # oldest version only, not v1's g2
        await buf.commit("g0", _group("g0", 0))
        assert [x.group_id for x in s.select(buf, 1, 10)] == ["g0", "g1"]
        # at version 3, v0 groups are out of the window (3 - 0 > 2): evicted, and v1 becomes the oldest
        assert sorted(x.group_id for x in s.evict(buf, 3)) == ["g0", "g1"]
        assert s.staleness_bound == 2

    asyncio.run(main())


def test_windowed_select_window_and_freshest_first():
    async def main():
        buf = ReplayBuffer(16)
        s = make_sampler(_cfg({"type": "windowed", "max_staleness_versions": 1, "sample_freshest_first": True}))
        await _fill(buf, s, [(0, True), (1, True), (2, True), (2, True)])
        # trainer at 2: window [1, 2]; freshest first: v2 groups, then v1; v0 is evicted
        assert [x.group_id for x in s.select(buf, 2, 10)] == ["g2", "g3", "g1"]
        assert [x.group_id for x in s.evict(buf, 2)] == ["g0"]

    asyncio.run(main())


def test_ready_first_takes_any_ready_in_order_and_never_evicts():
    async def main():
        buf = ReplayBuffer(16)
        s = make_sampler(_cfg({"type": "ready_first", "max_staleness_versions": 1}))
        await _fill(buf, s, [(0, False), (0, True), (1, True)])
        assert [x.group_id for x in s.select(buf, 9, 10)] == ["g1", "g2"]
        assert s.evict(buf, 100) == [] and s.staleness_bound is None

    asyncio.run(main())


def test_in_order_evicts_groups_of_steps_already_trained():
    async def main():
        buf = ReplayBuffer(16)
        s = make_sampler(_cfg({"type": "in_order", "max_lookahead_versions": 1}))
        await _fill(buf, s, [(0, True), (0, True), (0, True)])
        assert [x.group_id for x in s.evict(buf, 1)] == ["g0", "g1"]

    asyncio.run(main())


class GoodSampler:
    name = "mine"
    stamps = False
    staleness_bound = 0
    window = None
    carry_bound = None
    lookahead = 0

    def __init__(self, num_prompts_per_step, bias=0):
        self.p, self.bias, self.n = num_prompts_per_step, bias, 0

    def next_target_step(self): return self.n // self.p
    def can_admit(self, v): return True
    def admit(self, v): self.n += 1
    def select(self, buffer, v, k): return [s for s in buffer.ready() if s.start_version == v][:k]
    def evict(self, buffer, v): return [s for s in buffer.ready() if s.start_version < v]
    def should_abort_inflight(self, slot, v): return slot.start_version < v
    def required_capacity(self): return self.p
    def state_dict(self): return {"n": self.n}
    def load_state_dict(self, st): self.n = st["n"]
    def lookahead_at(self, v): return self.staleness_bound
    def observe(self, step, metrics): return {}
    def carry_over(self, buffer, step, need): return []


class BadSampler:
    name = "bad"

    def select(self, buffer, v, k): return []


def test_custom_sampler_is_imported_and_checked():
    mod = types.ModuleType("my_samplers")
    mod.GoodSampler, mod.BadSampler = GoodSampler, BadSampler
    sys.modules["my_samplers"] = mod
    s = make_sampler(_cfg({"type": "custom", "target": "my_samplers:GoodSampler", "kwargs": {"bias": 3}}))
    assert s.bias == 3 and s.name == "mine"
    with pytest.raises(RecipeError, match="missing: next_target_step"):
        make_sampler(_cfg({"type": "custom", "target": "my_samplers:BadSampler"}))
    with pytest.raises(RecipeError, match="importable module"):
        make_sampler(_cfg({"type": "custom", "target": "no_such_module_xyz:Cls"}))


def test_ready_first_requires_importance_sampling():
    with pytest.raises(RecipeError, match="loss.importance_sampling.enabled"):
        validate_dict({"async_rl": {"sampler": {"type": "ready_first"}}, "loss": {"importance_sampling": {"enabled": False}}})


def test_custom_sampler_without_the_partial_rollout_members_is_refused():
    # carry_over / carry_bound are protocol members the train pump calls on every sampler
    members = {k: v for k, v in vars(GoodSampler).items() if k not in ("carry_over", "__dict__", "__weakref__")}
    mod = types.ModuleType("my_old_samplers")
    mod.NoCarry = type("NoCarry", (), members)
    sys.modules["my_old_samplers"] = mod
    with pytest.raises(RecipeError, match="carry_over"):
        make_sampler(_cfg({"type": "custom", "target": "my_old_samplers:NoCarry"}))
    assert make_sampler(_cfg({"type": "in_order", "max_lookahead_versions": 1})).carry_bound is None
    assert make_sampler(_cfg({"type": "windowed"})).carry_over(None, 0, 4) == []
