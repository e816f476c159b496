"""The whole loop on CPU with the real small parts: GRPO learns the toy task, in both
asynchronous and synchronous modes, and no trained group exceeds the staleness bound."""

from __future__ import annotations

import statistics

import pytest

from rl_core.metrics.logger import read_jsonl

STEPS = 400  # at 300 the synchronous run rose +9 to +11 points, at the +10 threshold


def _check_learning(summary, run_dir, bound):
    before, after = summary["val_start"]["accuracy"], summary["val_end"]["accuracy"]
    assert after - before >= 0.10, f"held-out accuracy {before:.3f} -> {after:.3f} (< +10 points)"
    steps = read_jsonl(run_dir / "metrics.jsonl", kind="train")
    assert len(steps) == STEPS == summary["rl_steps"]
    rewards = [r["train/reward_mean"] for r in steps]
    first, last = statistics.fmean(rewards[:50]), statistics.fmean(rewards[-50:])
    assert last > first + 0.05, f"mean train reward did not rise: {first:.3f} -> {last:.3f}"
    # staleness of every trained group, over the whole run
    assert max(r["staleness/max"] for r in steps) <= bound
    assert summary["max_staleness"] <= bound == summary["staleness_bound"]


@pytest.mark.slow
def test_async_grpo_learns(run_recipe):
    summary, run_dir = run_recipe(f"grpo.max_num_steps={STEPS}", "async_rl.sampler.max_lookahead_versions=1",
                                  "validation.val_period=0")
    _check_learning(summary, run_dir, bound=1)
    assert summary["max_staleness"] == 1, "one-step-off run never trained a group generated one version earlier"


@pytest.mark.slow
def test_sync_grpo_learns(run_recipe):
    summary, run_dir = run_recipe(f"grpo.max_num_steps={STEPS}", "async_rl.sampler.max_lookahead_versions=0",
                                  "validation.val_period=0")
    _check_learning(summary, run_dir, bound=0)


def test_staleness_bound_two_is_reached_and_respected(run_recipe):
    summary, run_dir = run_recipe("grpo.max_num_steps=40", "async_rl.sampler.max_lookahead_versions=2",
                                  "async_rl.max_buffered_groups=48", "validation.val_at_start=false",
                                  "validation.val_at_end=false")
    steps = read_jsonl(run_dir / "metrics.jsonl", kind="train")
    assert max(r["staleness/max"] for r in steps) <= 2
    assert summary["max_staleness"] <= 2
