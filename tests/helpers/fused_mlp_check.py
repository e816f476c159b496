"""The fused gate/up + SiLU kernel (fused_mlp.gate_up_silu) against the eager MLP's first half,
on any device the kernel runs on (CUDA, or the CPU under TRITON_INTERPRET=1): shared by the
unit and GPU tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.helpers.interpreted import print_gaps

# (rows, hidden, m, bias): ragged tiles, a bias, one row, and (GPU) the Qwen2.5-0.5B shape
CASES = ((5, 64, 96, False), (33, 40, 50, True), (1, 32, 32, False))
QWEN = (256, 896, 4864, False)


def compare(device: str, dtype: torch.dtype, rows: int, hidden: int, m: int, bias: bool,
            tma: bool | None = None) -> tuple[float, float]:
    """(largest gap relative to the largest output, mean gap relative to the mean output) of
    gate_up_silu (`tma`: its TMA-descriptor kernel forced on or off; None: its own choice) against
    F.silu(gate) * up from F.linear, same inputs."""
    from rl_core.generation.native.fused_mlp import gate_up_silu

    gen = torch.Generator().manual_seed(rows * 7 + m)
    x = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    w = (torch.randn(2 * m, hidden, generator=gen) / hidden ** 0.5).to(device, dtype)
    b = torch.randn(2 * m, generator=gen).to(device, dtype) if bias else None
    gate, up = F.linear(x, w, b).chunk(2, dim=-1)
    ref = (F.silu(gate) * up).float()
    got = gate_up_silu(x, w, b, tma=tma)
    assert got.shape == (rows, m) and got.dtype == dtype
    gap = (got.float() - ref).abs()
    return gap.max().item() / ref.abs().max().item(), gap.mean().item() / ref.abs().mean().item()


def check(dtype: torch.dtype, gaps: tuple[float, float]) -> None:
    """float32: the same sums in another order; bf16/fp16: a few units in the last place of
    the rounded projections (the products are rounded to the dtype twice on each path)."""
    worst, mean = gaps
    if dtype == torch.float32:
        assert worst < 1e-5 and mean < 1e-6, gaps
    else:
        assert worst < 2 ** -5 and mean < 2 ** -8, gaps


def engine_gap(device: str) -> dict:
    """Greedy tokens and logprobs of four static-path engines: the torch attention (each layer
    `decode_layer`, then the final norm) and three through the fused stack (fused_stack.py: the
    fused attention kernel, residual adds joined to the next norm): with the torch MLP, with the
    fused MLP kernel (both with the split-K output and down projections), and with the fused MLP
    and the projections on torch's matmul (`fused_stack.SPLIT_K` off). Whether each fused engine's
    tokens equal the torch engine's, and the largest logprob gap."""
    from rl_core.generation.native import fused_stack
    from tests.helpers.engine_models import make_engine, prompts, run, tiny_model
    from rl_core.types import GenerationRequest, SamplingParams

    model = tiny_model("qwen2", 0, 0.3, max_positions=64).to(device)
    reqs = [GenerationRequest(str(i), p, SamplingParams(greedy=True, max_tokens=6 + i)) for i, p in
            enumerate(prompts(5, seed=3))]
    kw = dict(device=device, decode_path="static", max_batch_size=4)
    ref = run(make_engine(model, **kw), reqs)
    out = {}
    for name, extra in (("attention", {}), ("mlp", {"decode_mlp": "fused"}), ("mlp_no_split_k", {"decode_mlp": "fused"})):
        fused_stack.SPLIT_K = name != "mlp_no_split_k"
        try:
            engine = make_engine(model, decode_attention="fused", **kw, **extra)
        finally:
            fused_stack.SPLIT_K = True
        assert engine.decoder._stack.split_k == (name != "mlp_no_split_k")
        got = run(engine, reqs)
        assert engine.decoder.fused_attention and engine.decoder.fused_mlp == name.startswith("mlp")
        out[name] = {"same_tokens": all(got[r.request_id].token_ids == ref[r.request_id].token_ids for r in reqs),
                     "logprob_gap": max(abs(a - b) for r in reqs for a, b in
                                        zip(got[r.request_id].logprobs, ref[r.request_id].logprobs))}
    return out


if __name__ == "__main__":  # one JSON line per comparison (the unit test runs this under TRITON_INTERPRET=1)
    import json
    import sys

    where = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    print_gaps(compare, CASES, where)
    print(json.dumps({"engine": engine_gap(where)}))
