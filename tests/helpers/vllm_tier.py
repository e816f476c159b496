"""Helpers shared by the vLLM tier's test modules (tests/vllm)."""

from __future__ import annotations

import asyncio

import torch

from rl_core.packing import make_train_chunk
from rl_core.types import Sample

from tests.helpers.paths import ROOT, TINY_RECIPE as RECIPE  # noqa: F401  (the tier's modules import both from here)

PROMPTS = ["07+45=", "99+01=", "50+50=", "12+34="]


def started(loop, backend):
    """`backend` started on the tier's event loop; shut down again (its processes ended) when the
    start fails, so that a failed fixture leaves no vLLM process behind."""
    try:
        loop.run_until_complete(backend.start())
    except BaseException:
        backend.close_sync()
        raise
    return backend


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


def check_group_call(loop, backend, tokenizer, worker: str) -> None:
    """A vLLM backend's group call: the rollout's consecutive seeds make one request of n (vLLM
    seeds sample i with seed + i) sample what a request per sample samples; seeds that are
    not consecutive (given by hand) go as a request a sample, the same samples."""
    from rl_core.columns import GroupResults
    from rl_core.rollout.group import GroupOptions, group_call_ok
    from rl_core.types import SamplingParams, group_requests

    env = type("SingleTurn", (), {"runs_episodes": False, "max_turns": 1})()
    assert group_call_ok(backend, env, GroupOptions())
    params = SamplingParams(temperature=1.0, max_tokens=16)
    prompt = encode_prompt(tokenizer, 3)
    seeds = [(1 << 62) + 5 + i for i in range(8)]
    added = backend._stats["requests_added"]
    group = loop.run_until_complete(backend.generate_group("vg", prompt, params, seeds))
    assert backend._stats["requests_added"] == added + 1  # one request for the group
    singles = generate_all(loop, backend, group_requests("vs", prompt, params, seeds))
    assert type(group) is GroupResults and len(group) == 8
    assert group.worker == worker and group.workers is None
    same = sum(list(group.token_ids[i]) == r.token_ids for i, r in enumerate(singles))
    assert same >= 7, f"only {same} of 8 samples equal their own request's"  # batch composition may move a logit
    assert len({tuple(t) for t in group.token_ids}) > 1
    assert all(list(v) == [backend.weight_version] * len(t) for v, t in zip(group.token_versions, group.token_ids))
    added = backend._stats["requests_added"]
    apart = loop.run_until_complete(backend.generate_group("va", prompt, params, seeds[::-1]))
    assert backend._stats["requests_added"] == added + 8
    assert sum(list(a) == list(b) for a, b in zip(apart.token_ids, group.token_ids[::-1])) >= 7
