"""On the same weights and tokens, the generation engine's logprobs equal the trainer's
(mean |difference| < 1e-3, fp32 CPU), for sampling at T=1 and T=0.7."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rl_core.config.schema import TrainerConfig
from rl_core.generation.native.backend import NativeBackend
from rl_core.generation.native.engine import NativeEngine
from rl_core.train.torch_trainer import TorchTrainer
from rl_core.packing import make_train_chunk
from rl_core.types import GenerationRequest, SamplingParams, Sample


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generation_and_trainer_logprobs_agree(warm_policy, temperature):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(warm_policy))
    prompts = [tok.encode(f"{a:02d}+{b:02d}=", add_special_tokens=False) for a, b in [(7, 45), (99, 1), (50, 50)]]

    async def gen():
        backend = NativeBackend(NativeEngine.from_pretrained(warm_policy))
        await backend.start()
        try:
            reqs = [GenerationRequest(f"r{i}", prompts[i % 3], SamplingParams(temperature=temperature, max_tokens=8,
                                                                              seed=i)) for i in range(48)]
            return await asyncio.gather(*(backend.generate(r) for r in reqs))
        finally:
            await backend.shutdown()

    results = asyncio.run(gen())
    samples = [Sample(r.prompt_ids, r.token_ids, r.logprobs, 0.0, r.finish_reason, 0, 0) for r in results]
    chunk = make_train_chunk(samples, [0.0] * len(samples), pad_id=tok.pad_token_id)
    trainer = TorchTrainer(warm_policy, TrainerConfig(), logprob_temperature=temperature)
    lp = trainer.logprobs(chunk)
    mask = chunk.loss_mask.bool()
    err = (lp[mask] - chunk.gen_logprobs[mask]).abs()
    assert mask.sum() > 48
    assert err.mean().item() < 1e-3, err.mean().item()
    assert err.max().item() < 1e-2


def test_first_step_of_a_run_is_on_policy(run_recipe):
    """At RL step 1 every group was generated with version 0 weights: the logged error is tiny."""
    from rl_core.metrics.logger import read_jsonl

    _, run_dir = run_recipe("grpo.max_num_steps=2", "validation.val_at_start=false", "validation.val_at_end=false")
    first = read_jsonl(run_dir / "metrics.jsonl", kind="train")[0]
    assert first["train/gen_logprob_abs_error"] < 1e-3
    assert first["staleness/max"] == 0
    assert torch.isfinite(torch.tensor(first["train/loss"]))


def test_overlapped_static_decode_in_the_rl_loop(run_recipe):
    """The static decode path with `overlap_steps` through the whole loop on the CPU: refits
    drain the step in flight, the first step stays on policy, and steps were launched ahead."""
    from rl_core.metrics.logger import read_jsonl

    _, run_dir = run_recipe("grpo.max_num_steps=4", "validation.val_at_start=false", "validation.val_at_end=false",
                            "generation.native.decode_path=static", "generation.native.overlap_steps=true",
                            name="overlap")
    rows = read_jsonl(run_dir / "metrics.jsonl", kind="train")
    assert len(rows) == 4
    assert rows[0]["train/gen_logprob_abs_error"] < 1e-3 and rows[0]["staleness/max"] == 0
    assert rows[-1]["generation/ahead_steps"] > 0 and rows[-1]["generation/weight_updates"] >= 3
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in rows)
