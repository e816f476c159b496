"""Helpers shared by the vLLM tier's test modules (tests/vllm)."""

from __future__ import annotations

import asyncio

import torch

from rl_core.packing import make_train_chunk
from rl_core.types import Sample

from tests.helpers.paths import ROOT, TINY_RECIPE as RECIPE  # noqa: F401  (the tier's modules import both from here)

PROMPTS = ["07+45=", "99+01=", "50+50=", "12+34="]


def encode_prompt(tokenizer, i):
    return tokenizer.encode(PROMPTS[i % len(PROMPTS)], add_special_tokens=False)


def trainer_logprobs(trainer, results, temperature, pad_id, state=None):
    """Per-token logprobs of each result's completion under the trainer (optionally with `state`)."""
    samples = [Sample(r.prompt_ids, r.token_ids, r.logprobs, 0.0, r.finish_reason, 0, 0) for r in results]
    chunk = make_train_chunk(samples, [0.0] * len(samples), pad_id=pad_id)
    saved = None
    if state is not None:
        saved = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.model.load_state_dict(state)
    trainer.temperature = temperature
    try:
        lp = trainer.logprobs(chunk)
    finally:
        if saved is not None:
            trainer.model.load_state_dict(saved)
        trainer.temperature = 1.0
    return chunk, lp


def generate_all(loop, backend, requests):
    async def go():
        return await asyncio.gather(*(backend.generate(r) for r in requests))

    return loop.run_until_complete(go())


def perturbed_weights(trainer, scale=0.05, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {k: (v + scale * torch.randn(v.shape, generator=gen) * v.abs().mean()).contiguous()
            for k, v in trainer.export_weights().items() if not k.endswith("lm_head.weight")}
