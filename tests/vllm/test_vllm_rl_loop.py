"""The asynchronous RL loop with vLLM generating (`generation.backend: vllm`), built by
`rl_core.launch.train.build_parts` like any run: counted in RL steps, never seconds."""

from __future__ import annotations

import shutil

import pytest

from rl_core.metrics.logger import read_jsonl
from tests.helpers.vllm_tier import RECIPE, ROOT


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_async_grpo_steps_with_vllm_generating(tiny_policy, tmp_path, monkeypatch, placement):
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import train_from_recipe

    monkeypatch.chdir(ROOT)
    cfg = load_recipe(RECIPE, [
        f"output_dir={tmp_path}", "run_name=vllm", "logging.tensorboard=false", "model.warmup.enabled=false",
        "model.tiny.tie_word_embeddings=true", "generation.backend=vllm", f"generation.placement={placement}",
        "generation.vllm.max_model_len=64", "generation.max_batch_size=64", "grpo.max_num_steps=4",
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "async_rl.max_buffered_groups=8",
        "async_rl.min_groups_for_streaming_train=2", "validation.max_val_samples=16", "validation.val_period=0"])
    shutil.copytree(tiny_policy, tmp_path / "vllm" / "init_policy")  # the same tied random-init policy
    summary = train_from_recipe(cfg)
    run_dir = tmp_path / "vllm"

    assert summary["rl_steps"] == 4
    train = read_jsonl(run_dir / "metrics.jsonl", kind="train")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    # step 1 trains on version-0 samples: vLLM's logprobs are the trainer's on the same tokens
    assert train[0]["staleness/max"] == 0
    assert train[0]["train/gen_logprob_abs_error"] < 1e-3
    # later steps ran on refitted weights: generation served the versions the trainer published
    assert all(r["staleness/max"] <= 1 for r in train)
    assert train[-1]["generation/weight_version"] >= 3
    assert train[-1]["generation/weight_updates"] >= 3
    assert all(r["train/gen_logprob_abs_error"] < 0.05 for r in train)  # in-flight switches included
    (setup,) = read_jsonl(run_dir / "metrics.jsonl", kind="setup")
    assert setup["timing/setup/overlap_s"] > 0  # vLLM started while the trainer was built
    assert summary["val_start"] is not None and summary["val_end"]["weight_version"] == 4
