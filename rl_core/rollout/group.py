"""Generating and scoring one prompt group (used by the rollout pump and by validation).

Owns: per-sample seed derivation (so a sample's randomness depends only on the run seed,
the epoch, the example and the sample index, never on timing), turning recipe sampling
knobs into engine `SamplingParams`, fanning the N requests of a group out to a backend,
and scoring each finished completion with the environment.

Does not own: when groups are dispatched (rollout pump), the buffer, or retries.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rl_core.config.schema import SamplingParamsConfig
from rl_core.protocols import Environment, GenerationBackend
from rl_core.types import GenerationRequest, GenerationResult, Sample, SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # Steele, Lea & Flood 2014, "Fast splittable pseudorandom number generators"
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that depends only on `parts` (stable across processes and platforms)."""
    h = 0x5EED
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h >> 1


def sampling_params(cfg: SamplingParamsConfig, stop_token_ids: tuple[int, ...] = (),
                    extra_stop_strings: tuple[str, ...] = ()) -> SamplingParams:
    return SamplingParams(
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, greedy=cfg.greedy,
        max_tokens=cfg.max_tokens, stop_token_ids=tuple(stop_token_ids),
        stop_strings=tuple(cfg.stop) + tuple(extra_stop_strings),
    )


def score_result(env: Environment, tokenizer, example: dict[str, Any], result: GenerationResult) -> Sample:
    text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    scored = env.score(example, result.token_ids, text, result.finish_reason)
    info = dict(scored.info)
    info["text"] = text
    if result.token_versions is not None:
        info["token_versions"] = result.token_versions
    return Sample(
        prompt_ids=list(result.prompt_ids), completion_ids=list(result.token_ids),
        gen_logprobs=list(result.logprobs), reward=float(scored.reward), finish_reason=result.finish_reason,
        start_version=result.start_version, end_version=result.end_version, rewards=dict(scored.rewards),
        env_mask=bool(scored.mask), info=info,
    )


async def generate_group(backend: GenerationBackend, env: Environment, tokenizer, example: dict[str, Any],
                         prompt_ids: list[int], n: int, params: SamplingParams, key: str,
                         seed_parts: tuple[int, ...]) -> list[Sample]:
    """N samples of one prompt, generated concurrently, each with its own derived seed."""
    from dataclasses import replace

    requests = [GenerationRequest(f"{key}/{i}", list(prompt_ids), replace(params, seed=derive_seed(*seed_parts, i)))
                for i in range(n)]
    results = await asyncio.gather(*(backend.generate(r) for r in requests))
    return [score_result(env, tokenizer, example, r) for r in results]


def is_correct(sample: Sample) -> bool:
    """`info['correct']` when the environment reports it, else reward > 0."""
    c = sample.info.get("correct")
    return bool(c) if c is not None else sample.reward > 0
