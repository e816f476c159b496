"""Partial rollouts of the `in_order` sampler (`async_rl.sampler.partial_rollouts`): a step's
stragglers are carried over to a later step (they keep generating across refits) instead of
being waited for, never beyond `max_staleness_versions`; the recipe checks; the pairing rule."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from rl_core.buffer.replay_buffer import ReplayBuffer
from rl_core.controller.controller import Controller
from rl_core.errors import RecipeError
from rl_core.samplers import make_sampler
from rl_core.types import GenerationResult, PromptGroup

from tests.helpers.fakes import FakeBackend, FakeTrainer, make_parts
from tests.helpers.recipes import controller_recipe

_ID = re.compile(r"-p(\d+)-.*/(\d+)$")


class StragglerBackend(FakeBackend):
    """Generates token by token (`tick_s` per token), recording the weight version of every token;
    sample 0 of every third prompt is a straggler (`long` tokens), the others take `short`."""

    def __init__(self, short: int = 2, long: int = 60, tick_s: float = 0.002):
        super().__init__(seed=0, max_latency_s=0.0)
        self.short, self.long, self.tick_s = short, long, tick_s

    def length(self, request_id: str) -> int:
        m = _ID.search(request_id)
        return self.long if m and int(m.group(1)) % 3 == 0 and m.group(2) == "0" else self.short

    async def generate(self, request):
        self.calls += 1
        v0 = self.version
        versions = []
        for _ in range(self.length(request.request_id)):
            await asyncio.sleep(self.tick_s)
            versions.append(self.version)
        n = len(versions)
        return GenerationResult(request.request_id, request.prompt_ids, [5] * n, [-0.5] * n, "stop", v0,
                                self.version, token_versions=versions)


def _cfg(partial: bool, bound: int = 2, lookahead: int = 1, steps: int = 8):
    sampler = {"type": "in_order", "max_lookahead_versions": lookahead}
    if partial:
        sampler["partial_rollouts"] = {"enabled": True, "max_staleness_versions": bound}
    return controller_recipe(grpo={"max_num_steps": steps},
                             async_rl={"sampler": sampler, "max_buffered_groups": 4 * (lookahead + 1)})


def _run(tmp_path, cfg, steps: int = 8):
    backend = StragglerBackend()
    parts = make_parts(cfg, backend=backend, num_examples=4 * (steps + 4))
    records = []
    ctl = Controller(cfg, parts, tmp_path, total_steps=steps)
    ctl.step_observers.append(records.append)
    summary = asyncio.run(ctl.run())
    return ctl, summary, records, backend


def test_stragglers_are_carried_over_and_never_trained_beyond_the_bound(tmp_path):
    steps, bound = 8, 2
    ctl, summary, records, backend = _run(tmp_path / "on", _cfg(True, bound, steps=steps), steps)
    trained = [(r.step, t) for r in records for t in r.trained]
    # every step trained its full quota, each group once, nothing wasted or aborted
    assert [len(r.trained) for r in records] == [4] * steps
    assert len({t.slot.group_id for _, t in trained}) == 4 * steps
    assert ctl.rollout.stats.wasted_samples == 0 and ctl.rollout.stats.aborted_groups == 0
    carried = [(s, t) for s, t in trained if t.slot.carried]
    # stragglers were carried over (counted per step and in total) ...
    assert carried, "no straggler was carried over to a later step"
    assert sum(r.metrics["async/carried_groups"] for r in records) == len(carried)
    assert summary["carried_groups"] == records[-1].metrics["async/carried_groups_total"] >= len(carried)
    # ... trained beyond the lookahead (1) but never beyond the carry bound, measured by the
    # dispatch version and by the oldest token of every sample
    assert max(t.staleness for _, t in trained) == bound, "no carried group reached the bound"
    for s, t in trained:
        assert t.staleness == s - t.slot.start_version <= bound
        assert s - min(x.start_version for x in t.group.samples) <= bound  # the oldest token's version
    # the carried stragglers kept generating across refits: their long sample spans versions
    assert any(max(x.end_version - x.start_version for x in t.group.samples) > 0 for _, t in carried)
    assert all(t.group.target_step == s for s, t in trained), "a trained group's stamp is not its step"
    # groups that were never carried keep the lookahead bound
    assert all(t.staleness <= 1 for _, t in trained if not t.slot.carried)
    assert records[-1].metrics["async/trained_staleness_bound"] <= bound
    assert backend.calls == 4 * steps * 2  # no sample generated twice (no aborts, no retries)


def test_without_partial_rollouts_the_step_waits_for_its_stragglers(tmp_path):
    steps = 8
    ctl, summary, records, _ = _run(tmp_path / "off", _cfg(False, steps=steps), steps)
    assert summary["carried_groups"] == 0 and "async/carried_groups" not in records[-1].metrics
    assert max(t.staleness for r in records for t in r.trained) <= 1
    assert all(not t.slot.carried for r in records for t in r.trained)


def _slot(buf, gid, dispatch, start, target, ready):
    buf.reserve(gid, dispatch, dispatch, 0, start, target)
    if ready:
        group = PromptGroup(group_id=gid, prompt_index=dispatch, epoch=0, example={}, samples=[],
                            start_version=start, end_version=start, target_step=target)
        asyncio.run(buf.commit(gid, group))
    return buf.get(gid)


def test_pairing_takes_the_earliest_straggler_and_the_nearest_later_step_within_the_bound():
    sampler = make_sampler(_cfg(True, bound=2, lookahead=1))
    buf = ReplayBuffer(32)
    _slot(buf, "s0a", 0, 0, 0, ready=False)  # stragglers of step 0, dispatched at version 0
    _slot(buf, "s0b", 1, 0, 0, ready=False)
    _slot(buf, "r2", 5, 0, 2, ready=True)  # ready, step 2: carrying a straggler there gives staleness 2
    _slot(buf, "r1", 4, 0, 1, ready=True)
    pairs = sampler.carry_over(buf, 0, need=2)
    assert [(g.group_id, h.group_id) for g, h in pairs] == [("s0a", "r1"), ("s0b", "r2")]
    assert sampler.admitted_bound[1] == sampler.admitted_bound[2] == 2
    # a ready group of the step itself: nothing to carry for one group
    _slot(buf, "own", 2, 0, 0, ready=True)
    assert sampler.carry_over(buf, 0, need=1) == []
    # beyond the bound: a straggler dispatched at version 0 cannot move to step 3 (staleness 3 > 2)
    buf2 = ReplayBuffer(32)
    _slot(buf2, "old", 0, 0, 0, ready=False)
    _slot(buf2, "r3", 1, 1, 3, ready=True)
    assert sampler.carry_over(buf2, 0, need=1) == []
    # disabled: never pairs
    assert make_sampler(_cfg(False)).carry_over(buf, 0, need=2) == []


def test_restamp_moves_ready_and_reserved_slots_between_steps():
    buf = ReplayBuffer(8)
    _slot(buf, "g", 0, 0, 0, ready=False)
    h = _slot(buf, "h", 1, 0, 1, ready=True)
    buf.restamp("h", 0)
    buf.restamp("g", 1)
    assert [s.group_id for s in buf.ready_for_target(0)] == ["h"] and buf.ready_for_target(1) == []
    assert h.group.target_step == 0 and [s.group_id for s in buf.reserved_for_target(1)] == ["g"]


@pytest.mark.parametrize("sampler, extra, field", [
    ({"type": "in_order", "max_lookahead_versions": 2,
      "partial_rollouts": {"enabled": True, "max_staleness_versions": 2}}, {},
     "async_rl.sampler.partial_rollouts.max_staleness_versions"),
    ({"type": "in_order", "max_lookahead_versions": 1, "adaptive": {"enabled": True},
      "partial_rollouts": {"enabled": True, "max_staleness_versions": 5}}, {},
     "async_rl.sampler.partial_rollouts.enabled"),
    ({"type": "in_order", "max_lookahead_versions": 1,
      "partial_rollouts": {"enabled": True, "max_staleness_versions": 2}}, {"reproducible": True},
     "async_rl.sampler.partial_rollouts.enabled"),
])
def test_recipe_errors_name_the_field(sampler, extra, field):
    with pytest.raises(RecipeError) as e:
        controller_recipe(async_rl={"sampler": sampler, **extra})
    assert field in str(e.value)


class DoomedStragglerBackend(StragglerBackend):
    """The first straggler group fails (a data error) after generating its long sample."""

    def __init__(self):
        super().__init__()
        self.doomed: str | None = None

    async def generate(self, request):
        group = request.request_id.split("/")[0]
        long = self.length(request.request_id) == self.long
        if long and self.doomed is None:
            self.doomed = group
        result = await super().generate(request)
        if long and group == self.doomed:
            raise ValueError(f"bad example in {group}")
        return result


def test_a_carried_straggler_that_is_dropped_shrinks_the_step_it_was_carried_to(tmp_path):
    steps = 6
    cfg = controller_recipe(grpo={"max_num_steps": steps}, async_rl={
        "sampler": {"type": "in_order", "max_lookahead_versions": 1,
                    "partial_rollouts": {"enabled": True, "max_staleness_versions": 3}},
        "max_buffered_groups": 8,
        "failure": {"max_data_attempts_per_group": 1, "max_dropped_groups": 1, "on_dropped_group": "shrink",
                    "min_step_batch_fraction": 0.5}})
    backend = DoomedStragglerBackend()
    parts = make_parts(cfg, backend=backend, num_examples=4 * (steps + 4))
    records = []
    ctl = Controller(cfg, parts, tmp_path, total_steps=steps)
    ctl.step_observers.append(records.append)
    asyncio.run(asyncio.wait_for(ctl.run(), timeout=60))
    original = int(backend.doomed.rsplit("-d", 1)[1]) // 4  # its step at dispatch (4 groups per step)
    assert ctl.rollout.stats.dropped_groups == 1
    (dropped_step,) = [s for s, n in ctl.rollout.dropped_per_step.items() if n]
    assert dropped_step > original, "the dropped straggler had not been carried"
    assert [len(r.trained) for r in records] == [3 if r.step == dropped_step else 4 for r in records]


class CheckpointableTrainer(FakeTrainer):
    """A fake trainer whose saved model directory passes the checkpoint's structure check."""

    def save_pretrained(self, out_dir):
        super().save_pretrained(out_dir)
        (Path(out_dir) / "config.json").write_text("{}")


def test_carried_marks_and_total_survive_a_checkpoint(tmp_path):
    from rl_core.checkpoint import load_run_checkpoint, save_run_checkpoint

    steps, stop = 8, 4
    cfg = _cfg(True, bound=3, steps=steps)
    parts = make_parts(cfg, backend=StragglerBackend(), trainer=CheckpointableTrainer(), num_examples=4 * (steps + 4))
    saved = {}

    def checkpoint_fn(version, state):
        saved["state"] = state
        saved["marks"] = {r["group_id"]: r["carried"] for r in state["buffer"]["ready"]}
        save_run_checkpoint(tmp_path / "ck", trainer=parts.trainer, tokenizer=parts.tokenizer,
                            controller_state=state, resolved_config={})

    first = Controller(cfg, parts, tmp_path / "a", total_steps=steps, stop_step=stop, checkpoint_fn=checkpoint_fn)
    asyncio.run(asyncio.wait_for(first.run(), timeout=60))
    assert first.train.carried_groups > 0 and saved["state"]["train"]["carried_groups"] == first.train.carried_groups

    loaded = load_run_checkpoint(tmp_path / "ck", restore_rng=False)
    assert {r["group_id"]: r["carried"] for r in loaded.controller_state["buffer"]["ready"]} == saved["marks"]
    # resume: the total continues from the checkpoint, and restored ready groups keep their mark
    parts2 = make_parts(cfg, backend=StragglerBackend(), trainer=CheckpointableTrainer(), num_examples=4 * (steps + 4))
    parts2.trainer.load_state_dict(loaded.trainer_state)
    records = []
    second = Controller(cfg, parts2, tmp_path / "b", total_steps=steps, restore=loaded.controller_state)
    second.setup()
    assert {s.group_id: s.carried for s in second.buffer.ready()} == saved["marks"]
    assert second.train.carried_groups == first.train.carried_groups
    second.step_observers.append(records.append)
    asyncio.run(asyncio.wait_for(second.run(), timeout=60))
    assert [r.step for r in records] == list(range(stop, steps))
    moved_after = second.train.carried_groups - first.train.carried_groups
    assert moved_after >= 0 and records[-1].metrics["async/carried_groups_total"] == second.train.carried_groups
    restored_carried = {g for g, n in saved["marks"].items() if n}
    trained_carried = {t.slot.group_id for r in records for t in r.trained if t.slot.carried}
    assert restored_carried <= trained_carried  # counted in async/carried_groups of the step that trains them
    assert sum(r.metrics["async/carried_groups"] for r in records) == len(trained_carried)


def test_a_checkpoint_without_carried_marks_still_loads():
    # buffer state and controller state written before the marks were kept: never carried, total 0
    buf = ReplayBuffer(8)
    _slot(buf, "g", 0, 0, 1, ready=True).carried = 2
    state = buf.state_dict()
    assert state["ready"][0]["carried"] == 2
    old = {**state, "ready": [{k: v for k, v in r.items() if k != "carried"} for r in state["ready"]]}
    again = ReplayBuffer(8)
    again.load_state_dict(old)
    assert again.get("g").carried == 0 and again.ready_for_target(1)[0].group_id == "g"
    again.load_state_dict(state)
    assert again.get("g").carried == 2
