"""Sampling: filters, inverse-CDF draws, reported logprobs and per-request generators,
checked against hand-computed values."""

from __future__ import annotations

import math

import torch

from rl_core.generation.native.sampling import CDF_BLOCK, SamplingBatch, filter_logits, inverse_cdf, new_generator, sample
from rl_core.types import SamplingParams


def batch_for(params, generators=None, seed=0):
    generators = generators or [None] * len(params)
    return SamplingBatch.build(params, generators, new_generator(seed), "cpu")


def test_inverse_cdf_picks_by_cumulative_mass_and_never_a_zero_token():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]] * 6)
    u = torch.tensor([0.0, 0.0999, 0.1001, 0.6999, 0.7001, 1.0 - 1e-16], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [0, 0, 2, 2, 3, 3]
    tail_zero = torch.tensor([[0.5, 0.5, 0.0]])
    assert inverse_cdf(tail_zero, torch.tensor([1.0 - 1e-17], dtype=torch.float64)).tolist() == [1]
    unnormalised = torch.tensor([[2.0, 0.0, 6.0]])  # only relative mass matters
    assert inverse_cdf(unnormalised, torch.tensor([0.3], dtype=torch.float64)).tolist() == [2]


def test_two_level_inverse_cdf_equals_the_flat_cdf_across_blocks():
    """Vocabularies of several blocks (one padded), sparse rows with whole empty blocks,
    and uniforms at block edges: the same token as a flat float64 cdf search."""
    g = torch.Generator().manual_seed(0)
    for vocab in (CDF_BLOCK * 3, CDF_BLOCK * 5 + 37):
        probs = torch.rand(64, vocab, generator=g) ** 8
        probs[probs < 0.3] = 0.0  # sparse: zero tokens and, with the next line, empty blocks
        probs[::3, CDF_BLOCK:2 * CDF_BLOCK] = 0.0
        u = torch.rand(64, generator=g, dtype=torch.float64)
        u[:4] = torch.tensor([0.0, 1.0 - 1e-17, 0.5, 1.0 / 3])
        cdf = probs.double().cumsum(dim=-1)
        flat = torch.searchsorted(cdf, (u.clamp(max=1.0 - 2.0**-40) * cdf[:, -1])[:, None], right=True).squeeze(1)
        got = inverse_cdf(probs, u)
        assert torch.equal(got, flat)
        assert (probs.gather(1, got[:, None]) > 0).all()


def test_top_k_keeps_ties_and_top_p_keeps_the_smallest_nucleus():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]] * 3)
    b = batch_for([SamplingParams(top_k=2), SamplingParams(top_k=3), SamplingParams(top_k=0)])
    kept = filter_logits(logits, b) > float("-inf")
    assert kept.tolist() == [[False, True, True, False], [False, True, True, True], [True] * 4]

    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]] * 4))
    b = batch_for([SamplingParams(top_p=p) for p in (0.5, 0.6, 0.81, 1.0)])
    kept = filter_logits(logits, b) > float("-inf")
    assert kept.tolist() == [[False, True, False], [False, True, True], [True, True, True], [True, True, True]]


def test_logprobs_are_before_filtering_and_draws_follow_the_filtered_distribution():
    n = 20000
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4])).repeat(n, 1)
    params = [SamplingParams(temperature=0.5, top_k=2)] * n
    tokens, logprobs = sample(logits, batch_for(params, seed=1))
    want_lp = torch.log_softmax(logits[0] / 0.5, dim=-1)
    assert torch.allclose(logprobs, want_lp[tokens], atol=1e-6)
    assert set(tokens.tolist()) == {2, 3}
    # filtered at T=0.5: p ~ (0.3^2, 0.4^2) renormalised
    expected_3 = 0.4**2 / (0.3**2 + 0.4**2)
    freq_3 = (tokens == 3).double().mean().item()
    assert abs(freq_3 - expected_3) < 4 * math.sqrt(expected_3 * (1 - expected_3) / n)


def test_greedy_rows_take_the_argmax_and_report_logprobs_at_temperature_one():
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 1.0, 5.0]])
    params = [SamplingParams(greedy=True, temperature=0.3), SamplingParams(temperature=0.0)]
    tokens, logprobs = sample(logits, batch_for(params))
    assert tokens.tolist() == [1, 0]  # first index on ties
    assert torch.allclose(logprobs, torch.log_softmax(logits, dim=-1)[[0, 1], [1, 0]])


def test_a_seeded_row_draws_from_its_own_generator_whatever_its_neighbours():
    reference = new_generator(42)
    expected = [torch.rand(1, generator=reference, dtype=torch.float64).item() for _ in range(2)]
    gen = new_generator(42)
    got = []
    for step in range(2):  # the neighbours and the shared generator change every step
        params = [SamplingParams()] * (3 + step) + [SamplingParams(seed=42), SamplingParams(greedy=True)]
        gens = [None] * (3 + step) + [gen, None]
        got.append(batch_for(params, gens, seed=step).uniform[3 + step].item())
    assert got == expected
