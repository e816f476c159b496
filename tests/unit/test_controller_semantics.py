"""Controller semantics with fake backend/trainer: refit drain vs in-flight, validation and
rollout admission, the stall watchdog, loss-driven logprob refresh predicates."""

from __future__ import annotations

import asyncio

import pytest

from rl_core.controller.controller import Controller
from rl_core.controller.train_pump import needs_prev_logprobs, needs_reference_logprobs
from rl_core.errors import StallError
from rl_core.packing import make_train_chunk
from rl_core.types import Sample

from tests.helpers.fakes import FakeBackend, make_parts
from tests.helpers.recipes import controller_recipe


class SlowTrainerBackend(FakeBackend):
    """Latencies long enough that generations are in flight when refits happen."""

    def __init__(self):
        super().__init__(seed=1, max_latency_s=0.03)


def _run(tmp_path, cfg, backend=None, val_examples=None, total=6):
    parts = make_parts(cfg, backend=backend or SlowTrainerBackend())
    if val_examples is not None:
        parts.val_examples = val_examples
    ctl = Controller(cfg, parts, tmp_path, total_steps=total)
    return ctl, asyncio.run(ctl.run())


@pytest.mark.parametrize("mode", ["in_flight", "drain"])
def test_refit_modes_and_versions_spanned(tmp_path, mode):
    spans = []
    cfg = controller_recipe(async_rl={"sampler": {"type": "in_order", "max_lookahead_versions": 2}, "refit_mode": mode,
                         "max_buffered_groups": 12})
    parts = make_parts(cfg, backend=SlowTrainerBackend())

    def on_step(record):
        spans.extend((s.start_version, s.end_version) for t in record.trained for s in t.group.samples)

    ctl = Controller(cfg, parts, tmp_path, total_steps=6)
    ctl.step_observers.append(on_step)
    asyncio.run(ctl.run())
    spanning = sum(1 for a, b in spans if a != b)
    if mode == "drain":
        assert spanning == 0, "a sample spans two weight versions under the drain gate"
    else:
        assert spanning > 0, "no sample was generated across a refit in in-flight mode"


def test_validation_does_not_pause_admission_by_default(tmp_path):
    from rl_core.controller.events import Timeline

    vals = [{"id": i, "prompt": str(i), "answer": "x"} for i in range(24)]
    cfg = controller_recipe(async_rl={"sampler": {"type": "in_order", "max_lookahead_versions": 2}, "max_buffered_groups": 12},
               validation={"val_period": 2}, logging={"jsonl": True})
    ctl, _ = _run(tmp_path / "a", cfg, val_examples=vals)
    spans = Timeline.read(tmp_path / "a" / "timeline.jsonl")
    val = [s for s in spans if s.kind == "validate"]
    gen = [s for s in spans if s.kind == "generate"]
    assert val, "no validation ran"
    assert any(g.start < v.end and v.start < g.end for v in val for g in gen), \
        "no rollout generated while a validation ran"

    cfg = controller_recipe(async_rl={"sampler": {"type": "in_order", "max_lookahead_versions": 2}, "max_buffered_groups": 12},
               validation={"val_period": 2, "pause_rollouts": True}, logging={"jsonl": True})
    _run(tmp_path / "b", cfg, val_examples=vals)
    spans = Timeline.read(tmp_path / "b" / "timeline.jsonl")
    val = [s for s in spans if s.kind == "validate"]
    gen = [s for s in spans if s.kind == "generate"]
    assert val and not any(v.start < g.start < v.end for v in val for g in gen), \
        "a rollout was dispatched while a validation ran with pause_rollouts"


class HangingBackend(FakeBackend):
    async def generate(self, request):
        await asyncio.sleep(3600)


def test_watchdog_reports_what_each_pump_waits_on(tmp_path):
    cfg = controller_recipe(async_rl={"watchdog": {"interval_s": 0.05, "stall_timeout_s": 0.3, "action": "abort"}})
    with pytest.raises(StallError) as err:
        _run(tmp_path, cfg, backend=HangingBackend())
    text = str(err.value)
    assert "Rollout pump waits on:" in text and "Train pump waits on:" in text and "groups in flight" in text
    assert "ready group(s) for step 0" in text


def test_logprob_refresh_predicates():
    assert not needs_prev_logprobs(controller_recipe())
    assert needs_prev_logprobs(controller_recipe(grpo={"ppo_epochs": 2}))
    assert needs_prev_logprobs(controller_recipe(grpo={"num_minibatches": 2}))
    assert not needs_reference_logprobs(controller_recipe())
    assert needs_reference_logprobs(controller_recipe(loss={"kl_coef": 0.01}))


def test_train_chunk_masks_observation_tokens():
    s = Sample([1, 2], [5, 6, 9, 9, 7], [-0.1, -0.2, 0.0, 0.0, -0.3], 1.0, "stop", 0, 0,
               completion_mask=[1, 1, 0, 0, 1])
    c = make_train_chunk([s], [1.0])
    assert c.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert c.num_valid_tokens() == 3


class LaterGroupsHangBackend(FakeBackend):
    """Groups dispatched after the first `fast` answer at once; later ones generate for an hour."""

    def __init__(self, fast: int):
        super().__init__(seed=0, max_latency_s=0.0)
        self.fast = fast

    async def generate(self, request):
        dispatch_index = int(request.request_id.split("/")[0].rsplit("-d", 1)[1])
        if dispatch_index >= self.fast:
            await asyncio.sleep(3600)
        return await super().generate(request)


def test_run_end_aborts_groups_no_step_will_train(tmp_path):
    # over-sampling dispatches more groups than the two steps train; the run ends when the last
    # step has trained, aborting those still generating instead of waiting for them (an hour here)
    cfg = controller_recipe(grpo={"max_num_steps": 2},
                            async_rl={"sampler": {"type": "windowed", "max_staleness_versions": 4},
                                      "over_sampling_ratio": 2.0, "max_buffered_groups": 24,
                                      "max_inflight_groups": 24})
    parts = make_parts(cfg, backend=LaterGroupsHangBackend(fast=8))
    ctl = Controller(cfg, parts, tmp_path, total_steps=2)

    async def run():
        return await asyncio.wait_for(ctl.run(), timeout=20)

    summary = asyncio.run(run())
    assert summary["rl_steps"] == 2
    stats = ctl.rollout.stats
    assert stats.dispatched_groups > 8 and stats.aborted_groups == stats.dispatched_groups - stats.committed_groups > 0
    assert stats.wasted_samples >= 2 * stats.aborted_groups and not ctl.rollout.inflight
    assert ctl.rollout.waiting_on == "done"
