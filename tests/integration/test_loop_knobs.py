"""Controller knobs proven in the real loop (native engine, torch trainer, both pumps; a few
RL steps of the tiny recipe each): each test asserts the knob's behaviour (counts, bounds,
metrics), not only that the run finishes.

- `async_rl.max_inflight_generations`: training generations in flight never exceed it, and
  reach it (without it, the over-sampling runs below have more in flight);
- `async_rl.recompute_kv_cache_after_weight_updates` set in the recipe: one KV-cache
  invalidation per refit, none when off;
- `validation.val_start_at` and validation's own sampling parameters;
- `async_rl.over_sampling_ratio` (unstamped sampler): live groups stay under
  ceil(ratio * groups the trainer can still consume in the window); with 1.0 every generated
  group is used (or evicted), with 2.0 more groups are generated than used;
- stale in-flight abort (windowed sampler): a group still generating when it leaves the
  staleness window is cancelled and counted in `rollout/aborted_stale_inflight_groups`;
- reward shaping (scaling) and dynamic sampling in a run: zero-variance groups set aside and
  the step refilled; its budget error when they exceed the budget;
- PPO critic warm-up (`critic.num_warmup_steps`): the policy is frozen, the critic trains.

The generation backend is the real one behind a wrapper that counts (and, for the stale
abort, holds chosen groups until they are cancelled: timing the test must control)."""

from __future__ import annotations

import asyncio
import json
import math
import re

import pytest
import torch

from rl_core.launch.preflight import load_recipe
from rl_core.controller.controller import Controller
from rl_core.launch.train import build_parts

from tests.helpers.paths import ROOT, TINY_RECIPE as RECIPE

P = 4  # prompts per RL step
N = 4  # samples per prompt
SMALL = [f"grpo.num_prompts_per_step={P}", f"grpo.num_generations_per_prompt={N}", "validation.val_at_start=false",
         "validation.val_at_end=false", "logging.tensorboard=false", "async_rl.min_groups_for_streaming_train=2"]
TRAINING_REQUEST = re.compile(r"^e\d+-p\d+-d(\d+)/a(\d+)/")


class Watched:
    """The real backend, counted: training generations in flight (now and at most), live groups
    of the controller's buffer at each training request, KV-cache invalidations, each request's
    sampling parameters. `hold(dispatch_index, attempt)` -> True keeps that request waiting until
    it is cancelled (at most `hold_s`)."""

    def __init__(self, inner, hold=None, hold_s: float = 600.0):
        self.inner = inner
        self.hold, self.hold_s = hold, hold_s
        self.ctl: Controller | None = None
        self.running = self.max_running = self.max_live = self.invalidations = 0
        self.requests: list[tuple[str, object]] = []
        self.held: set[int] = set()
        self.held_cancelled: set[int] = set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request):
        self.requests.append((request.request_id, request.params))
        m = TRAINING_REQUEST.match(request.request_id)
        if m is None:  # validation
            return await self.inner.generate(request)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        if self.ctl is not None and self.ctl.buffer is not None:
            self.max_live = max(self.max_live, self.ctl.buffer.live())
        try:
            d, a = int(m.group(1)), int(m.group(2))
            if self.hold is not None and self.hold(d, a):
                self.held.add(d)
                try:
                    await asyncio.sleep(self.hold_s)
                except asyncio.CancelledError:
                    self.held_cancelled.add(d)
                    raise
            return await self.inner.generate(request)
        finally:
            self.running -= 1

    async def invalidate_kv_cache(self):
        self.invalidations += 1
        await self.inner.invalidate_kv_cache()


def run_knobs(tmp_path, warm_policy, monkeypatch, *overrides: str, steps: int = 3, name: str = "run", hold=None,
         wrap_trainer=None, wrap_critic=None):
    monkeypatch.chdir(ROOT)
    cfg = load_recipe(RECIPE, [f"output_dir={tmp_path}", f"run_name={name}", f"grpo.max_num_steps={steps}",
                               *SMALL, *overrides])
    parts = build_parts(cfg, warm_policy)
    parts.backend = backend = Watched(parts.backend, hold=hold)
    if wrap_trainer is not None:
        parts.trainer = wrap_trainer(parts.trainer)
    if wrap_critic is not None:
        parts.critic = wrap_critic(parts.critic)
    ctl = Controller(cfg, parts, tmp_path / name, total_steps=steps)
    backend.ctl = ctl
    summary = asyncio.run(ctl.run())
    assert summary["rl_steps"] == steps
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return ctl, backend, [r for r in records if r["kind"] == "train"], cfg


def test_generation_backpressure_kv_recompute_and_validation_knobs(tmp_path, warm_policy, monkeypatch):
    cap = N + 2  # the config requires >= N (a whole group); two groups (2N) would exceed it
    ctl, backend, recs, cfg = run_knobs(
        tmp_path, warm_policy, monkeypatch, f"async_rl.max_inflight_generations={cap}",
        "async_rl.recompute_kv_cache_after_weight_updates=true",
        "validation.val_period=1", "validation.val_start_at=2", "validation.max_val_samples=4",
        "validation.num_val_generations_per_prompt=2", "validation.sampling.greedy=false",
        "validation.sampling.temperature=0.7", "validation.sampling.top_k=5", "validation.sampling.max_tokens=5",
        name="knobs")
    assert backend.max_running == cap
    assert backend.invalidations == 3  # one per refit (one refit per RL step)
    # validation: only after step 2 (val_start_at=2; the last step's is the end validation, off here)
    assert [v["label"] for v in ctl.validations] == ["step2"] and ctl.validations[0]["weight_version"] == 2
    val = [p for rid, p in backend.requests if rid.startswith("step2-")]
    train = [p for rid, p in backend.requests if TRAINING_REQUEST.match(rid)]
    assert ctl.validations[0]["num_prompts"] == 4 and len(val) == 4 * 2
    assert {(p.greedy, p.temperature, p.top_k, p.max_tokens) for p in val} == {(False, 0.7, 5, 5)}
    assert {(p.greedy, p.temperature, p.top_k, p.max_tokens) for p in train} == {(False, 1.0, 0, 8)}


@pytest.mark.parametrize("ratio", [1.0, 2.0])
def test_over_sampling_ratio_bounds_generated_vs_used_groups(tmp_path, warm_policy, monkeypatch, ratio):
    window = 1
    ctl, backend, recs, cfg = run_knobs(tmp_path, warm_policy, monkeypatch, "async_rl.sampler.type=windowed",
                                   f"async_rl.sampler.max_staleness_versions={window}",
                                   f"async_rl.over_sampling_ratio={ratio}", name=f"os{ratio}")
    rs, counts = ctl.rollout.stats, ctl.buffer.counts
    used = len(ctl.train.trained_group_ids)
    assert used == 3 * P
    bound = math.ceil(ratio * P * (window + 1))  # live groups, whatever the trainer's demand
    assert backend.max_live <= bound
    assert backend.invalidations == 0  # recompute_kv_cache_after_weight_updates off (default)
    assert backend.max_running > N + 2  # no generation-level cap: more than the capped run's 6 at once
    # every generated group is trained, evicted, aborted or left over
    leftover = ctl.buffer.live()
    assert rs.dispatched_groups == used + counts["evicted"] + counts["aborted"] + leftover
    if ratio == 1.0:  # never more live groups than the trainer will still take
        assert leftover == 0 and backend.max_live <= P * (window + 1)
    else:
        assert backend.max_live > P * (window + 1)
        assert rs.dispatched_groups > used


def test_in_flight_group_leaving_the_window_is_aborted(tmp_path, warm_policy, monkeypatch):
    # windowed sampler with window 0: a group still generating when the trainer's version moves
    # past its start version is stale; dispatch indices 1 and 6 are held until cancelled
    ctl, backend, recs, cfg = run_knobs(tmp_path, warm_policy, monkeypatch, "async_rl.sampler.type=windowed",
                                   "async_rl.sampler.max_staleness_versions=0",
                                   hold=lambda d, a: d in (1, 6) and a == 0, name="stale")
    assert backend.held == {1, 6} and backend.held_cancelled == {1, 6}
    aborted = [r["rollout/aborted_stale_inflight_groups"] for r in recs]
    assert aborted == sorted(aborted) and aborted[-1] >= 2 and aborted[0] >= 1
    assert ctl.train.stale_aborted_groups == aborted[-1] == ctl.rollout.stats.aborted_groups
    trained_d = {int(g.rsplit("-d", 1)[1]) for g in ctl.train.trained_group_ids}
    assert not trained_d & {1, 6}
    assert all(s <= 0 for s in ctl.train.staleness_log)  # the window holds for what was trained


def test_dynamic_sampling_refills_the_step_and_its_budget_stops_the_run(tmp_path, warm_policy, monkeypatch):
    # the tiny policy (~10% accurate) gives many all-wrong groups: zero variance
    ctl, backend, recs, cfg = run_knobs(tmp_path, warm_policy, monkeypatch,
                                   "reward_shaping.dynamic_sampling.enabled=true",
                                   "reward_shaping.dynamic_sampling.max_num_dropped_groups_per_step=64",
                                   "reward_shaping.scaling.enabled=true", "reward_shaping.scaling.target_min=-1.0",
                                   "grpo.max_num_epochs=50", steps=2, name="ds")
    filtered = ctl.train.dynamic_filtered_groups
    assert filtered > 0 and ctl.rollout.stats.refill_groups == filtered  # in_order: one refill per drop
    assert recs[-1]["rollout/dynamic_filtered_groups"] == filtered
    assert len(ctl.train.trained_group_ids) == 2 * P  # each step refilled to its full size
    assert ctl.buffer.counts["evicted"] >= filtered  # set-aside groups leave the buffer as evicted
    # reward scaling [0, 1] -> [-1, 1] applied before the filter (a linear map keeps zero variance zero)
    for r in recs:
        assert r["shaping/reward_shaped_mean"] == pytest.approx(2 * r["shaping/reward_unshaped_mean"] - 1)
        assert r["train/reward_mean"] == pytest.approx(r["shaping/reward_shaped_mean"])
    with pytest.raises(RuntimeError, match=r"dynamic sampling dropped \d+ zero-variance groups while filling RL step \d+ "
                                           r"\(budget reward_shaping\.dynamic_sampling\.max_num_dropped_groups_per_step=0\)"):
        run_knobs(tmp_path, warm_policy, monkeypatch, "reward_shaping.dynamic_sampling.enabled=true",
             "reward_shaping.dynamic_sampling.max_num_dropped_groups_per_step=0", steps=2, name="ds_budget")


def test_critic_warmup_freezes_the_policy_and_trains_the_critic(tmp_path, warm_policy, monkeypatch):
    snapshots = []

    class Snap:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        @property
        def version(self):
            return self.inner.version

        def finish(self, advance_version=True):
            out = self.inner.finish(advance_version)
            snapshots.append({k: v.clone() for k, v in self.inner.model.state_dict().items()})
            return out

    ctl, backend, recs, cfg = run_knobs(tmp_path, warm_policy, monkeypatch, "critic.enabled=true",
                                   "advantage.estimator=gae", "critic.num_warmup_steps=2", wrap_trainer=Snap,
                                   name="warmup")
    assert len(snapshots) == 3
    same = [all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(snapshots, snapshots[1:])]
    assert same == [True, False]  # steps 0 and 1 frozen (equal weights after both); step 2 trains
    assert ctl.p.trainer.inner.optimizer_steps == 1  # the frozen steps took no optimizer step
    assert [r["train/policy_frozen"] for r in recs] == [1.0, 1.0, 0.0]
    assert ctl.p.critic.optimizer_steps == 3  # the critic trained in every step
    # a zero gradient only where the critic already predicts every target exactly (an all-wrong first
    # step: returns 0 and the zero-initialised value head)
    assert all(r["critic/grad_norm"] > 0 or r["critic/value_abs_error"] == 0 for r in recs)
    assert any(r["critic/grad_norm"] > 0 for r in recs)
