"""PPO with a critic and GDPO with two rewards learn the toy task on the real loop (CPU),
counted in RL steps."""

from __future__ import annotations

import shutil
import statistics

import pytest

from rl_core.launch.preflight import load_recipe
from rl_core.launch.train import train_from_recipe
from rl_core.metrics.logger import read_jsonl

from tests.helpers.paths import ROOT


def _run(tmp_path, warm_policy, monkeypatch, recipe, steps, *extra):
    monkeypatch.chdir(ROOT)
    cfg = load_recipe(ROOT / "recipes" / recipe, [f"output_dir={tmp_path}", "run_name=r", f"grpo.max_num_steps={steps}",
                                                  "logging.tensorboard=false", "validation.val_period=0", *extra])
    shutil.copytree(warm_policy, tmp_path / "r" / "init_policy")
    summary = train_from_recipe(cfg)
    return summary, read_jsonl(tmp_path / "r" / "metrics.jsonl", kind="train")


@pytest.mark.slow
def test_ppo_with_a_critic_learns(tmp_path, warm_policy, monkeypatch):
    # reproducible: the held-out gain does not depend on how loaded the machine is (async runs vary)
    summary, steps = _run(tmp_path, warm_policy, monkeypatch, "tiny-addition-ppo.yaml", 200, "async_rl.reproducible=true")
    before, after = summary["val_start"]["accuracy"], summary["val_end"]["accuracy"]
    print(f"[ppo] held-out accuracy {before:.3f} -> {after:.3f} in 200 RL steps")
    assert after - before >= 0.06, f"PPO held-out accuracy {before:.3f} -> {after:.3f}"
    assert "critic/loss" in steps[-1] and steps[-1]["train/advantage/value_mean"] != 0.0
    first = statistics.fmean(r["train/reward_mean"] for r in steps[:50])
    last = statistics.fmean(r["train/reward_mean"] for r in steps[-50:])
    assert last > first


@pytest.mark.slow
def test_gdpo_improves_both_rewards(tmp_path, warm_policy, monkeypatch):
    summary, steps = _run(tmp_path, warm_policy, monkeypatch, "tiny-addition-gdpo.yaml", 200,
                          "validation.val_at_start=false")
    for name in ("reward/correct", "reward/digits"):
        first = statistics.fmean(r[name] for r in steps[:50])
        last = statistics.fmean(r[name] for r in steps[-50:])
        print(f"[gdpo] {name}: mean of the first 50 steps {first:.3f} -> last 50 steps {last:.3f}")
        assert last > first + 0.02, f"{name} did not improve: {first:.3f} -> {last:.3f}"
