"""Property test over the real pumps, buffer and samplers (fake backend/trainer): whatever
the completion order and latencies, no trained group exceeds its sampler's staleness bound,
no group is trained twice, and every dispatched group is accounted for."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.fakes import FakeBackend, make_parts
from rl_core.config import validate_dict
from rl_core.controller.controller import Controller

SAMPLERS = [
    {"type": "in_order", "max_lookahead_versions": 0},
    {"type": "in_order", "max_lookahead_versions": 2},
    {"type": "weight_fifo", "max_staleness_versions": 1},
    {"type": "windowed", "max_staleness_versions": 1},
    {"type": "windowed", "max_staleness_versions": 0, "sample_freshest_first": True},
    {"type": "ready_first", "max_staleness_versions": 1},
]


def _run(tmp_path, sampler: dict, seed: int, streaming: int, ratio: float, max_latency: float):
    cfg = validate_dict({
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 2, "max_num_steps": 6, "seed": seed},
        "async_rl": {"sampler": sampler, "max_inflight_groups": 6, "max_buffered_groups": 12,
                     "min_groups_for_streaming_train": streaming,
                     "over_sampling_ratio": ratio if sampler["type"] != "in_order" else 1.0},
        "validation": {"val_at_start": False, "val_at_end": False},
        "logging": {"tensorboard": False, "jsonl": False, "progress": "off"},
    })
    parts = make_parts(cfg, backend=FakeBackend(seed, max_latency))
    ctl = Controller(cfg, parts, tmp_path / f"run{seed}", total_steps=6)
    summary = asyncio.run(ctl.run())
    return ctl, summary


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sampler=st.sampled_from(SAMPLERS), seed=st.integers(0, 10_000), streaming=st.integers(1, 4),
       ratio=st.sampled_from([1.0, 1.5]), max_latency=st.sampled_from([0.0005, 0.004]))
def test_staleness_bound_and_exactly_once(tmp_path, sampler, seed, streaming, ratio, max_latency):
    ctl, summary = _run(tmp_path, sampler, seed, streaming, ratio, max_latency)
    assert summary["rl_steps"] == 6
    ids = ctl.train.trained_group_ids
    assert len(ids) == len(set(ids)) == 6 * 4, "a group was trained twice or a step is short"
    bound = ctl.p.sampler.staleness_bound
    if bound is not None:
        assert max(ctl.train.staleness_log) <= bound
    rs = ctl.rollout.stats
    counts = ctl.buffer.counts
    # every dispatched group is trained, evicted, aborted, or still live (ready) at the end
    assert rs.dispatched_groups == counts["selected"] + counts["evicted"] + counts["aborted"] + ctl.buffer.live()
    assert counts["selected"] == len(ids)
