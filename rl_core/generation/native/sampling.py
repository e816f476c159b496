"""Token sampling for a batch of rows with per-row parameters, and the logprobs we report.

Owns: the one definition of a generation logprob the trainer must reproduce,
log_softmax(logits.float() / T)[token] with T = params.logprob_temperature (1 when greedy), on
the raw logits before any top-k/top-p filtering; how a token is drawn (greedy: the arg-max,
first index on ties; else temperature, top-k with ties at the k-th value kept, the smallest
top-p nucleus, and the inverse CDF of the filtered distribution with one uniform per row);
per-request `torch.Generator`s for seeded rows (their tokens depend neither on the batch nor
on arrival; the logits are batch-invariant only to kernel rounding); and top logprobs (the n
largest of the same distribution, computed only when some row asks).

Does not own: the logits (model.py) or when a request stops (engine.py).

Read more: docs/generation.md, "Per-request sampling and logprobs".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

from rl_core.types import SamplingParams


def new_generator(seed: int) -> torch.Generator:
    """A CPU generator for one request (uniforms are drawn on CPU whatever the device)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors on the logits' device; a field
    is None when no row needs it (fewer host-to-device copies per step)."""

    temperature: torch.Tensor | None  # [R] float32 logprob temperature (1 for greedy rows); None = all 1
    greedy: torch.Tensor | None  # [R] bool; None = no row or every row is greedy (see all_greedy)
    top_k: torch.Tensor | None  # [R] long, 0 = off; None = off for every row
    top_p: torch.Tensor | None  # [R] float32, 1 = off; None = off for every row
    uniform: torch.Tensor | None  # [R] float64 in [0, 1), one per row (greedy rows: unused); None = all greedy
    all_greedy: bool
    num_top_logprobs: int = 0  # the most top logprobs any row asks for (0 = none)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
              default_generator: torch.Generator, device: str | torch.device) -> "SamplingBatch":
        """One uniform per non-greedy row: from its own generator if it has one, else from
        `default_generator` (drawn in row order). Greedy rows consume no randomness."""
        greedy = [p.is_greedy for p in params]
        all_greedy = all(greedy)
        draws = draw_uniforms(params, generators, default_generator)
        uniform = None if draws is None else _to_device(draws, device)
        temperature = [p.logprob_temperature for p in params]
        top_k = [0 if g else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        return cls(
            temperature=None if all(t == 1.0 for t in temperature) else _tensor(temperature, torch.float32, device),
            greedy=_tensor(greedy, torch.bool, device) if any(greedy) and not all_greedy else None,
            top_k=_tensor(top_k, torch.long, device) if any(top_k) else None,
            top_p=_tensor(top_p, torch.float32, device) if any(p < 1.0 for p in top_p) else None,
            uniform=uniform,
            all_greedy=all_greedy,
            num_top_logprobs=max((p.top_logprobs for p in params), default=0),
        )


def is_plain(params: Sequence[SamplingParams]) -> bool:
    """True when `sample_plain` serves these rows: no top-k, top-p or top logprobs (greedy
    and temperature sampling only)."""
    return all(p.is_greedy or (p.top_k == 0 and p.top_p >= 1.0) for p in params) and not any(
        p.top_logprobs for p in params)


def draw_uniforms(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                  default_generator: torch.Generator) -> torch.Tensor | None:
    """One float64 uniform per row on the CPU (0 for greedy rows), or None when every row is
    greedy: rows without a generator of their own draw from `default_generator` in row
    order (one call), then each seeded row draws one from its own."""
    greedy = [p.is_greedy for p in params]
    if all(greedy):
        return None
    shared = [i for i, (g, gen) in enumerate(zip(greedy, generators)) if not g and gen is None]
    draws = torch.rand(len(shared), generator=default_generator, dtype=torch.float64)
    if len(shared) == len(params):
        return draws
    values = [0.0] * len(params)
    for i, u in zip(shared, draws.tolist()):
        values[i] = u
    for i, (g, gen) in enumerate(zip(greedy, generators)):
        if not g and gen is not None:
            values[i] = torch.rand(1, generator=gen, dtype=torch.float64).item()
    return torch.tensor(values, dtype=torch.float64)


def sample_plain(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                 uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and reported logprobs of rows without top-k/top-p filtering, with static
    shapes and no host synchronisation (the CUDA-graph decode step captures it):
    temperature [R] float32 (the logprob temperature, 1 for greedy rows), greedy [R] bool,
    uniform [R] float64. The same values as `sample_tokens` for such rows."""
    logprobs_all = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)  # x / 1.0 == x exactly
    tokens = torch.where(greedy, logits.argmax(dim=-1), inverse_cdf(logprobs_all.exp(), uniform))
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)


def _tensor(values: list, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    return _to_device(torch.tensor(values, dtype=dtype), device)


def _to_device(host: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """Copy to `device` without waiting for it: on CUDA through pinned memory (a copy from
    pageable memory would first wait for the work queued on the stream, e.g. the forward
    that the engine launches before building the sampling batch)."""
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class Sampled(NamedTuple):
    tokens: torch.Tensor  # [R] long
    logprobs: torch.Tensor  # [R] float32, reported logprob of each token
    top_ids: torch.Tensor | None  # [R, n] long, the n most likely tokens (n = batch.num_top_logprobs)
    top_logprobs: torch.Tensor | None  # [R, n] float32, their reported logprobs


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [R] (long) and their reported logprobs [R] (float32) for logits [R, V]."""
    out = sample_tokens(logits, batch)
    return out.tokens, out.logprobs


def sample_tokens(logits: torch.Tensor, batch: SamplingBatch) -> Sampled:
    """`sample`, plus the top logprobs when some row asks for them."""
    rows = logits.shape[0]
    temperature = batch.temperature if batch.temperature is not None else logits.new_ones(rows, dtype=torch.float32)
    if batch.top_k is None and batch.top_p is None and not batch.num_top_logprobs:
        greedy = batch.greedy if batch.greedy is not None else torch.full(
            (rows,), batch.all_greedy, dtype=torch.bool, device=logits.device)
        uniform = batch.uniform if batch.uniform is not None else logits.new_zeros(rows, dtype=torch.float64)
        tokens, chosen = sample_plain(logits, temperature, greedy, uniform)
        return Sampled(tokens, chosen, None, None)
    scaled = logits.float() / temperature[:, None]  # x / 1.0 == x exactly
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        # A row's probabilities are computed the same way whatever the other rows ask for
        # (filtering leaves an unfiltered row's values bit-identical, and exp(log_softmax)
        # is what `sample_plain` draws from), so seeded rows stay batch-invariant.
        filtered = scaled if batch.top_k is None and batch.top_p is None else filter_logits(scaled, batch)
        tokens = inverse_cdf(torch.log_softmax(filtered, dim=-1).exp(), batch.uniform)
        if batch.greedy is not None:
            tokens = torch.where(batch.greedy, logits.argmax(dim=-1), tokens)
    chosen = logprobs_all.gather(1, tokens[:, None]).squeeze(1)
    if not batch.num_top_logprobs:
        return Sampled(tokens, chosen, None, None)
    top = logprobs_all.topk(min(batch.num_top_logprobs, logprobs_all.shape[-1]), dim=-1)
    return Sampled(tokens, chosen, top.indices, top.values)


def filter_logits(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature-scaled logits with the tokens outside top-k / top-p set to -inf."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    vocab = scaled.shape[-1]
    remove_sorted = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if batch.top_k is not None:
        # Top-k (Fan et al. 2018): drop tokens strictly below the k-th largest value.
        k = batch.top_k.clamp(min=1, max=vocab)
        kth = sorted_logits.gather(1, (k - 1)[:, None])
        below = (sorted_logits < kth) & (batch.top_k > 0)[:, None]
        remove_sorted |= below
    if batch.top_p is not None:
        # Nucleus / top-p (Holtzman et al. 2019): keep the shortest prefix of the sorted
        # distribution whose mass reaches p, i.e. drop a token once the mass before it >= p.
        probs = torch.softmax(sorted_logits.masked_fill(remove_sorted, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove_sorted |= (mass_before >= batch.top_p[:, None]) & (batch.top_p < 1.0)[:, None]
        remove_sorted[:, 0] = False  # the most likely token always stays
    remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)
    return scaled.masked_fill(remove, float("-inf"))


CDF_BLOCK = 128  # tokens per block of the two-level inverse CDF


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Token index i with cdf[i-1] <= u * total < cdf[i] (vocabulary order), per row.

    The cdf is accumulated in float64 and u is capped at 1 - 2^-40, so u * total stays below the
    total and a zero-probability token (which does not raise the cdf) is never chosen.

    Two levels, so no kernel scans the whole vocabulary: the cdf over blocks of CDF_BLOCK
    tokens (each block summed in float32) picks the block, then the cdf inside that block
    (offset by the mass before it) picks the token. This is the flat cdf up to the float32
    rounding of the block sums (relative 1e-7 per block: a token changes only when u lies
    that close to a boundary); should that rounding put u * total past the block's last
    token, the block's last token with mass is taken.
    """
    rows, vocab = probs.shape
    pad = -vocab % CDF_BLOCK
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(rows, -1, CDF_BLOCK)  # [R, B, block]
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [R, B]
    target = (uniform.clamp(max=1.0 - 2.0**-40) * block_cdf[:, -1])[:, None]  # [R, 1]
    b = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)  # [R, 1]
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)), 0.0)
    chosen = blocks.gather(1, b[:, :, None].expand(rows, 1, CDF_BLOCK)).squeeze(1)  # [R, block]
    i = torch.searchsorted(chosen.double().cumsum(dim=-1) + before, target, right=True)
    index = torch.arange(CDF_BLOCK, device=probs.device)
    last = torch.where(chosen > 0, index, -1).amax(dim=-1, keepdim=True)
    return (b * CDF_BLOCK + torch.minimum(i, last)).squeeze(1)
