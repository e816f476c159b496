"""The one-GPU recipes' shape on a CPU (recipes/gpu-*.yaml with tiny overrides): the recipes
load, the long-tail data fits the model's positions, and two async RL steps of each run
in-process through the launch path (the GPU-only setting, compile, turned off). The
real sizes run in tests/gpu/test_gpu_recipes.py and bench/e2e_gpu.py."""

from __future__ import annotations

import json

import pytest

from rl_core.launch.preflight import load_recipe
from rl_core.launch.train import train_from_recipe
from tests.helpers.paths import ROOT

TINY = ["runtime.device=cpu", "model.dtype=float32", "trainer.compile=false", "runtime.torch_num_threads=1",
        "model.tiny.hidden_size=64", "model.tiny.num_hidden_layers=2", "model.tiny.num_attention_heads=4",
        "model.tiny.num_key_value_heads=2", "model.tiny.intermediate_size=128", "model.warmup.enabled=false",
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2",
        "async_rl.min_groups_for_streaming_train=2", "validation.max_val_samples=4", "validation.val_period=0",
        "validation.val_at_start=false", "logging.tensorboard=false", "logging.progress='off'"]


@pytest.mark.parametrize("name,extra", [
    ("gpu-addition", []),
    ("gpu-repeat", ["generation.max_tokens=32", "validation.sampling.max_tokens=32", "data.max_train_examples=32"]),
])
def test_gpu_recipe_shape_runs_two_async_steps_on_cpu(tmp_path, monkeypatch, name, extra):
    monkeypatch.chdir(ROOT)
    full = load_recipe(ROOT / "recipes" / f"{name}.yaml")
    assert full.model.warmup.device == "auto" and full.trainer.compile and full.model.dtype == "float32"
    assert full.async_rl.sampler.max_lookahead_versions == 1 and full.generation.placement == "colocated"
    cfg = load_recipe(ROOT / "recipes" / f"{name}.yaml", TINY + extra + [f"output_dir={tmp_path}", "run_name=r"])
    train_from_recipe(cfg)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(r["train/num_tokens"] > 0 for r in train)
