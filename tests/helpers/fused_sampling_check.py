"""Shared by the fused-sampling tests (CPU interpreter and CUDA): `sample_plain_fused` against
`sampling.sample_plain` on the same logits, temperatures, greedy flags and uniforms (ties
for greedy rows, u = 0 and u = 1, vocabularies that are not a multiple of the CDF block).

Run as a script (`python -m tests.helpers.fused_sampling_check DEVICE`), it prints one JSON
line per case; `check` holds the tolerances both tiers assert."""

from __future__ import annotations

import json
import sys

import torch

from rl_core.generation.native.fused_sampling import sample_plain_fused
from rl_core.generation.native.sampling import sample_plain

CASES = ((torch.float32, 1000, 16), (torch.bfloat16, 3001, 16), (torch.float32, 9501, 8))


def compare(device: str, dtype: torch.dtype, vocab: int, rows: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    logits[0, 7] = logits[0, vocab - 3] = 50  # a tie: greedy takes the first index
    temperature = 0.5 + torch.rand(rows, generator=g) * 1.5
    greedy = torch.arange(rows) % 3 == 0
    temperature[greedy] = 1.0
    uniform = torch.rand(rows, generator=g, dtype=torch.float64)
    uniform[1], uniform[2] = 0.0, 1.0
    args = [t.to(device) for t in (logits, temperature, greedy, uniform)]
    want, got = sample_plain(*args), sample_plain_fused(*args)
    return {"case": f"{dtype} V={vocab}", "tokens": want[0].tolist(), "fused_tokens": got[0].tolist(),
            "logprob_gap": (want[1] - got[1]).abs().max().item(), "logprob_scale": want[1].abs().max().item()}


def check(rows: list[dict]) -> None:
    """Same tokens (greedy, ties, both ends of u included) and logprobs to float32 rounding
    (a few ulps of the largest |logprob|: sums over the vocabulary in another order)."""
    for r in rows:
        assert r["tokens"] == r["fused_tokens"], r
        assert r["logprob_gap"] < 1e-6 * max(1.0, r["logprob_scale"]), r


if __name__ == "__main__":
    for dt, v, n in CASES:
        print(json.dumps(compare(sys.argv[1], dt, v, n)))
