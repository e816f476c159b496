"""Replay buffer slot life cycle and the in_order sampler's admission/selection rules."""

import asyncio

import pytest

from rl_core.buffer.replay_buffer import ReplayBuffer, SlotState
from rl_core.config.schema import InOrderSamplerConfig
from rl_core.samplers import InOrderSampler
from rl_core.types import PromptGroup


def group(gid, v):
    return PromptGroup(group_id=gid, prompt_index=0, epoch=0, example={}, samples=[], start_version=v, end_version=v)


def test_slot_life_cycle_and_capacity():
    async def main():
        buf = ReplayBuffer(capacity=2)
        buf.reserve("a", 0, 0, 0, 0, 0)
        buf.reserve("b", 1, 1, 0, 0, 0)
        assert not buf.has_capacity()
        with pytest.raises(RuntimeError):
            buf.reserve("c", 2, 2, 0, 0, 0)
        await buf.commit("a", group("a", 0))
        assert [s.group_id for s in buf.ready()] == ["a"] and buf.live() == 2
        await buf.finish(buf.ready(), SlotState.SELECTED)
        assert buf.has_capacity() and buf.live() == 1
        await buf.finish([buf.get("b")], SlotState.ABORTED)
        assert buf.live() == 0
        assert buf.counts["selected"] == 1 and buf.counts["aborted"] == 1 and buf.counts["reserved"] == 2

    asyncio.run(main())


def test_wait_for_capacity_wakes_on_release():
    async def main():
        buf = ReplayBuffer(capacity=1)
        buf.reserve("a", 0, 0, 0, 0, 0)
        waiter = asyncio.create_task(buf.wait_for(buf.has_capacity, timeout=5))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await buf.finish([buf.get("a")], SlotState.EVICTED)
        assert await waiter

    asyncio.run(main())


def test_in_order_admission_gate_and_targets():
    s = InOrderSampler(InOrderSamplerConfig(max_lookahead_versions=1), num_prompts_per_step=2)
    # version 0: steps 0 and 1 may be dispatched (lookahead 1), step 2 may not
    assert [s.admit(0) for _ in range(4)] == [0, 0, 1, 1]
    assert not s.can_admit(0) and s.can_admit(1)
    assert s.admit(1) == 2


def test_in_order_synchronous_gate():
    s = InOrderSampler(InOrderSamplerConfig(max_lookahead_versions=0), num_prompts_per_step=3)
    assert [s.admit(0) for _ in range(3)] == [0, 0, 0]
    assert not s.can_admit(0)
    with pytest.raises(RuntimeError):
        s.admit(0)


def test_in_order_selects_only_current_step_in_dispatch_order():
    async def main():
        buf = ReplayBuffer(capacity=8)
        s = InOrderSampler(InOrderSamplerConfig(max_lookahead_versions=1), num_prompts_per_step=2)
        for i in range(4):
            t = s.admit(0)
            buf.reserve(f"g{i}", i, i, 0, 0, t)
        for gid in ("g3", "g1", "g2"):
            await buf.commit(gid, group(gid, 0))
        assert [x.group_id for x in s.select(buf, 0, 10)] == ["g1"]
        assert [x.group_id for x in s.select(buf, 1, 10)] == ["g2", "g3"]
        assert [x.group_id for x in s.select(buf, 1, 1)] == ["g2"]

    asyncio.run(main())


def test_in_order_state_round_trip():
    s = InOrderSampler(InOrderSamplerConfig(max_lookahead_versions=2), num_prompts_per_step=4)
    for _ in range(7):
        s.admit(0)
    t = InOrderSampler(InOrderSamplerConfig(max_lookahead_versions=2), num_prompts_per_step=4)
    t.load_state_dict(s.state_dict())
    assert t.next_target_step() == s.next_target_step() == 1 and t.admit(0) == s.admit(0)
