"""The adaptive staleness bound (`async_rl.sampler.adaptive`) in the real loop (native engine,
torch trainer, both pumps; a few RL steps of the tiny recipe): the logged bound moves as the
rule says, and no trained group is staler than the bound in effect when it was dispatched
(checked from the logged bounds, independently of the sampler's own bookkeeping), nor than
the per-step `async/trained_staleness_bound`."""

from __future__ import annotations

import asyncio
import json

from rl_core.launch.preflight import load_recipe
from rl_core.controller.controller import Controller
from rl_core.launch.train import build_parts

from tests.helpers.paths import ROOT, TINY_RECIPE as RECIPE

P, N = 4, 4
SMALL = [f"grpo.num_prompts_per_step={P}", f"grpo.num_generations_per_prompt={N}", "validation.val_at_start=false",
         "validation.val_at_end=false", "logging.tensorboard=false", "async_rl.min_groups_for_streaming_train=2",
         "async_rl.sampler.adaptive.enabled=true", "async_rl.sampler.adaptive.patience_steps=1",
         "async_rl.sampler.adaptive.min_lookahead_versions=0"]  # the bound may reach synchronous (default floor: 1)


def _run(tmp_path, warm_policy, monkeypatch, *overrides: str, steps: int, name: str):
    monkeypatch.chdir(ROOT)
    cfg = load_recipe(RECIPE, [f"output_dir={tmp_path}", f"run_name={name}", f"grpo.max_num_steps={steps}",
                               *SMALL, *overrides])
    ctl = Controller(cfg, build_parts(cfg, warm_policy), tmp_path / name, total_steps=steps)
    summary = asyncio.run(ctl.run())
    assert summary["rl_steps"] == steps
    recs = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return ctl, [r for r in recs if r["kind"] == "train"], cfg


def _check_bounds_held(recs, start: int):
    """A group trained at step s with staleness k was dispatched at version s - k; the bound of
    version v is the starting one for v = 0, else the one logged after step v - 1."""
    bound_at = [start] + [int(r["async/staleness_bound"]) for r in recs]
    for s, r in enumerate(recs):
        k = int(r["staleness/max"])
        assert k <= bound_at[s - k], (s, k, bound_at)
        assert k <= r["async/trained_staleness_bound"] <= max(bound_at[: s + 1])


def test_bound_widens_to_its_maximum_and_the_wider_bound_is_used(tmp_path, warm_policy, monkeypatch):
    # thresholds far above any KL: every step is "low", patience 1 -> +1 per step up to max 2
    ctl, recs, cfg = _run(tmp_path, warm_policy, monkeypatch, "async_rl.sampler.max_lookahead_versions=0",
                          "async_rl.sampler.adaptive.max_lookahead_versions=2",
                          "async_rl.sampler.adaptive.low_threshold=10", "async_rl.sampler.adaptive.high_threshold=20",
                          steps=5, name="widen")
    assert [r["async/staleness_bound"] for r in recs] == [1, 2, 2, 2, 2]
    assert [r["async/staleness_bound_changes"] for r in recs] == [1, 2, 2, 2, 2]
    assert all(r["async/staleness_signal"] == r["train/gen_train_kl"] for r in recs)
    _check_bounds_held(recs, start=0)
    assert recs[0]["staleness/max"] == 0  # started synchronous
    assert max(r["staleness/max"] for r in recs) == 2  # the widened bound was used
    assert ctl.p.sampler.staleness_bound == 2 and ctl.p.sampler.state_dict()["adaptive"]["bound"] == 2


def test_bound_narrows_on_mismatch_in_a_reproducible_run(tmp_path, warm_policy, monkeypatch):
    # is_mult_prob_error (mean exp|logp_gen - logp_prev|) > 1 + 1e-6 whenever a group is stale:
    # the bound narrows from 2 to 0 and, once the wider pipeline drained, trains synchronously;
    # reproducible: the refit barrier follows the bound of each outgoing version
    ctl, recs, cfg = _run(tmp_path, warm_policy, monkeypatch, "async_rl.reproducible=true",
                          "async_rl.sampler.max_lookahead_versions=2",
                          "async_rl.sampler.adaptive.max_lookahead_versions=2",
                          "async_rl.sampler.adaptive.metric=is_mult_prob_error",
                          "async_rl.sampler.adaptive.low_threshold=1.0",
                          "async_rl.sampler.adaptive.high_threshold=1.000001", steps=10, name="narrow")
    bounds = [int(r["async/staleness_bound"]) for r in recs]
    assert bounds == sorted(bounds, reverse=True) and bounds[-1] == 0 and bounds[0] <= 2
    assert max(r["staleness/max"] for r in recs) >= 1  # it started asynchronous
    _check_bounds_held(recs, start=2)
    # the pipeline of the wider bound (at most 2 versions ahead) drains within 2 steps of reaching 0
    # (when it narrows depends on the first step that changes the weights: an all-wrong step does not)
    drained = bounds.index(0) + 2
    assert drained < len(recs) and all(r["staleness/max"] == 0 for r in recs[drained:])
    # reproducible: every group of a step has the same staleness
    assert all(r["staleness/max"] == r["staleness/mean"] for r in recs)


def test_resumed_reproducible_run_continues_the_same_bound_sequence(tmp_path, warm_policy, monkeypatch):
    # 6 reproducible RL steps with a checkpoint every 3; then the same run resumed from step 3
    # (`--resume-from`) must log the same bounds and signals for steps 3-5: the rule's state
    # (bound, previous bound, low count) and the per-step admitted bounds come from the checkpoint
    import shutil

    from rl_core.launch.train import train_from_recipe
    from rl_core.metrics.logger import read_jsonl

    monkeypatch.chdir(ROOT)
    cfg = load_recipe(RECIPE, [f"output_dir={tmp_path}", "run_name=res", "grpo.max_num_steps=6", *SMALL,
                               "async_rl.reproducible=true", "checkpoint.save_every_steps=3",
                               "async_rl.sampler.max_lookahead_versions=1",
                               "async_rl.sampler.adaptive.max_lookahead_versions=3",
                               "async_rl.sampler.adaptive.low_threshold=1e-4",
                               "async_rl.sampler.adaptive.high_threshold=1e-3"])
    run = tmp_path / "res"
    shutil.copytree(warm_policy, run / "init_policy")
    train_from_recipe(cfg)
    ref = read_jsonl(run / "metrics.jsonl", kind="train")
    bounds = [r["async/staleness_bound"] for r in ref]
    assert len(ref) == 6 and len(set(bounds)) > 1, bounds  # the bound moved during the run
    train_from_recipe(cfg, resume_from=run / "steps" / "step_000003")
    again = read_jsonl(run / "metrics.jsonl", kind="train")
    assert [r["step"] for r in again] == [r["step"] for r in ref]
    keys = ("async/staleness_bound", "async/trained_staleness_bound", "async/staleness_signal",
            "async/staleness_bound_changes", "staleness/max", "staleness/mean")
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in ref]
