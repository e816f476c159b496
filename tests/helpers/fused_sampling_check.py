"""Shared by the fused-sampling tests (CPU interpreter and CUDA): `sample_plain_fused` against
`sampling.sample_plain` on the same logits, temperatures, greedy flags and uniforms (ties
for greedy rows, u = 0 and u = 1, vocabularies that are not a multiple of the CDF block);
and `sample_packed` (the decode runner's layout) against `sample_plain_fused`: the same
values, and the tokens written to its `ids` too; and engines whose decode runner samples
by `sample_packed` against the runner's `sample_plain` (`engine_compare`).

Run as a script (`python -m tests.helpers.fused_sampling_check DEVICE`), it prints one JSON
line per case; `check` holds the tolerances both tiers assert."""

from __future__ import annotations

import json
import sys

import torch

import torch.nn.functional as F

from rl_core.generation.native.fused_sampling import sample_lm_head, sample_packed, sample_plain_fused
from rl_core.generation.native.sampling import sample_plain

CASES = ((torch.float32, 1000, 16), (torch.bfloat16, 3001, 16), (torch.float32, 9501, 8))


def compare(device: str, dtype: torch.dtype, vocab: int, rows: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    logits[0, 7] = logits[0, vocab - 3] = 50  # a tie: greedy takes the first index
    temperature = 0.5 + torch.rand(rows, generator=g) * 1.5
    greedy = torch.arange(rows) % 3 == 0
    temperature[greedy] = 1.0
    temperature[torch.arange(rows) % 3 == 1] = 1.0  # sampled rows at T = 1: the first pass skips its division
    uniform = torch.rand(rows, generator=g, dtype=torch.float64)
    uniform[1], uniform[2] = 0.0, 1.0
    args = [t.to(device) for t in (logits, temperature, greedy, uniform)]
    want, got = sample_plain(*args), sample_plain_fused(*args)
    # The runner's layout: params [3, n] float64 of which the first `rows` columns are used (row stride n).
    params = torch.zeros(3, rows + 5, dtype=torch.float64, device=device)
    params[:, :rows] = torch.stack([a.double() for a in args[1:]])
    ids = torch.full((rows + 2,), -1, dtype=torch.long, device=device)
    packed = sample_packed(args[0], params[:, :rows], ids[:rows])
    return {"case": f"{dtype} V={vocab}", "tokens": want[0].tolist(), "fused_tokens": got[0].tolist(),
            "logprob_gap": (want[1] - got[1]).abs().max().item(), "logprob_scale": want[1].abs().max().item(),
            "packed_same": torch.equal(packed[0], got[0].double()) and torch.equal(packed[1], got[1].double()),
            "ids": ids.tolist()}


# (dtype, vocab, rows, hidden) of `compare_lm_head`: vocabularies that are and are not a multiple of the CDF block.
LM_HEAD_CASES = ((torch.float32, 1000, 16, 64), (torch.bfloat16, 1280, 19, 64), (torch.float32, 300, 3, 32))


def compare_lm_head(device: str, dtype: torch.dtype, vocab: int, rows: int, hidden: int, seed: int = 0) -> dict:
    """`sample_lm_head` (the LM head with the first pass in its epilogue) against `sample_packed` on
    the logits of `F.linear`: sampled rows at several temperatures, greedy rows with a tie, u = 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * (2.0 / hidden ** 0.5)
    w[vocab - 2] = w[5]  # equal logits in two blocks: the greedy row 0 takes the first index
    h[0] = w[5] * 3
    h, w = h.to(dtype).to(device), w.to(dtype).to(device)
    inputs = torch.zeros(3, rows, dtype=torch.float64)
    greedy = torch.arange(rows) % 4 == 0
    inputs[0] = torch.where(greedy, 1.0, 0.5 + torch.rand(rows, generator=g, dtype=torch.float64))
    inputs[1] = greedy.double()
    inputs[2] = torch.rand(rows, generator=g, dtype=torch.float64)
    inputs[2, 1], inputs[2, 2] = 0.0, 1.0
    inputs = inputs.to(device)
    logits = F.linear(h, w)
    ids = torch.full((rows + 2,), -1, dtype=torch.long, device=device)
    want, got = sample_packed(logits, inputs), sample_lm_head(h, w, inputs, ids[:rows])
    return {"lm_head": f"{dtype} V={vocab}", "tokens": want[0].long().tolist(), "fused_tokens": got[0].long().tolist(),
            "logprob_gap": (want[1] - got[1]).abs().max().item(), "ids": ids.tolist(),
            # a logit rounded the other way to the model dtype moves its logprob by one ulp of it / T
            "tolerance": 1e-6 * max(1.0, want[1].abs().max().item()) + (
                0.0 if dtype == torch.float32 else 2.0 ** -7 * logits.float().abs().max().item() / 0.5)}


def check(rows: list[dict]) -> None:
    """Same tokens (greedy, ties, both ends of u included) and logprobs to float32 rounding
    (a few ulps of the largest |logprob|: sums over the vocabulary in another order); the packed
    form equal to `sample_plain_fused`, its ids the tokens and nothing past them written."""
    for r in rows:
        if "engine" in r:  # engine_compare's lines
            e = r["engine"]
            assert e["same_tokens"] and e["logprob_gap"] < 1e-5 and e["ahead_steps"] > 0, r
            assert (e["lm_head_steps"] > 0) == bool(e.get("lm_head")), r  # the fused head ran where asked, only there
            continue
        if "lm_head" in r:
            assert r["tokens"] == r["fused_tokens"] and r["ids"] == r["fused_tokens"] + [-1, -1], r
            assert r["logprob_gap"] <= r["tolerance"], r
            continue
        assert r["tokens"] == r["fused_tokens"], r
        assert r["packed_same"] and r["ids"] == r["fused_tokens"] + [-1, -1], r
        assert r["logprob_gap"] < 1e-6 * max(1.0, r["logprob_scale"]), r


def engine_compare(device: str, lm_head: bool = False) -> dict:
    """Engines on the static decode path with `overlap_steps` (each step fed the last one's tokens on
    the device), sampling in the step by `sample_packed` (the tokens left in the input ids) against
    `sample_plain` (the runner's path without the kernels): greedy and seeded requests. With
    `lm_head`, engines of the fused stack (`decode_attention: fused`) whose steps sample through
    `sample_lm_head` against the same stack's `sample_packed` after the LM head."""
    from rl_core.types import GenerationRequest, SamplingParams
    from tests.helpers.engine_models import make_engine, prompts, run, tiny_model

    model = tiny_model()
    reqs = [GenerationRequest(str(i), p, SamplingParams(greedy=True, max_tokens=6 + i) if i % 2 else
                              SamplingParams(temperature=0.8, max_tokens=5 + i, seed=10 + i))
            for i, p in enumerate(prompts(6))]
    from rl_core.generation.native import decode_graph

    results, calls = {}, []
    fused = decode_graph.sample_lm_head
    decode_graph.sample_lm_head = lambda *a, **k: calls.append(1) or fused(*a, **k)  # counts the fused steps
    try:
        for packed in (False, True):
            engine = make_engine(model, max_batch_size=4, decode_path="static", eos_token_ids=[], overlap_steps=True,
                                 device=device, **({"decode_attention": "fused"} if lm_head else {}))
            # the runner picks these with decode_compile on CUDA; here by hand
            if lm_head:
                engine.decoder._packed, engine.decoder._lm_head = True, packed
            else:
                engine.decoder._packed = packed
            results[packed] = run(engine, reqs)
            ahead = engine.stats.ahead_steps
    finally:
        decode_graph.sample_lm_head = fused
    a, b = results[True], results[False]
    return {"same_tokens": all(a[r.request_id].token_ids == b[r.request_id].token_ids for r in reqs),
            "logprob_gap": max(abs(x - y) for r in reqs for x, y in zip(a[r.request_id].logprobs, b[r.request_id].logprobs)),
            "ahead_steps": ahead, "lm_head_steps": len(calls)}

if __name__ == "__main__":
    for dt, v, n in CASES:
        print(json.dumps(compare(sys.argv[1], dt, v, n)))
    for dt, v, n, hid in LM_HEAD_CASES:
        print(json.dumps(compare_lm_head(sys.argv[1], dt, v, n, hid)))
    print(json.dumps({"engine": engine_compare(sys.argv[1])}))
    print(json.dumps({"engine": {**engine_compare(sys.argv[1], lm_head=True), "lm_head": True}}))
