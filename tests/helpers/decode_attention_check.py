"""Shared by the fused decode-attention tests (CPU interpreter and CUDA): one decode layer
of a random model through `decode_layer` (torch ops) and `decode_layer_fused` (the Triton
kernel), from the same cache contents, with positions spread over several key blocks.

Run as a script (`python -m tests.helpers.decode_attention_check DEVICE`), it prints one
JSON line per dtype: the largest gaps of the layer outputs and of the two caches;
`check_gaps` holds the tolerances both tiers assert."""

from __future__ import annotations

import json
import sys

import torch

from rl_core.generation.native.fused_stack import decode_layer_fused
from rl_core.generation.native.kv_cache import KVCache
from rl_core.generation.native.model import CausalLM, ModelSpec, decode_layer


def compare(device: str, dtype: torch.dtype, heads: int = 8, kv_heads: int = 2, head_dim: int = 16,
            positions: tuple[int, ...] = (0, 1, 63, 64, 65, 130, 199), seed: int = 0) -> dict:
    """Largest |torch - fused| of the layer output and of the key/value caches after the step,
    and the largest |output| (the scale of the gaps)."""
    torch.manual_seed(seed)
    hidden = heads * head_dim
    spec = ModelSpec("qwen2", 50, hidden, 1, heads, kv_heads, head_dim, 2 * hidden, 1e-6, 10000.0, 256, True, False,
                     False, True, (1,))
    model = CausalLM(spec, 256, device, dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    caches = [KVCache(1, len(positions) + 1, 256, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2)]
    keys, values = torch.randn_like(caches[0].k), torch.randn_like(caches[0].v)
    for c in caches:
        c.k.copy_(keys)
        c.v.copy_(values)
    pos = torch.tensor(positions, device=device)
    n, key_len = len(positions), max(positions) + 1
    x = torch.randn(n, hidden, dtype=dtype, device=device)
    cos, sin = model._cos[pos].unsqueeze(1), model._sin[pos].unsqueeze(1)
    slots = torch.arange(n, device=device)
    masked = torch.arange(key_len, device=device)[None, :] > pos[:, None]
    args = (x, cos, sin, slots, pos, masked, model.decode_weights()[0])
    kw = dict(heads=heads, kv_heads=kv_heads, eps=1e-6)
    want = decode_layer(*args, caches[0].k[0], caches[0].v[0], None, None, **kw)
    got = decode_layer_fused(*args, caches[1].k[0], caches[1].v[0], None, None, **kw)
    gap = lambda a, b: (a.float() - b.float()).abs().max().item()  # noqa: E731
    return {"dtype": str(dtype), "out_gap": gap(want, got), "out_scale": want.float().abs().max().item(),
            "k_gap": gap(caches[0].k, caches[1].k), "k_scale": caches[0].k.float().abs().max().item(),
            "v_gap": gap(caches[0].v, caches[1].v), "v_scale": caches[0].v.float().abs().max().item()}


def check_gaps(rows: list[dict]) -> None:
    """The tolerances of both tiers: float32 to float rounding; bf16 within a few bf16 ulps
    of the output's scale, the keys within one rounding of RoPE, the values within one rounding of
    the QKV projection (the fused stack's is a Triton matmul, `split_k.linear`, summing in another
    order than F.linear)."""
    fp32, bf16 = rows
    assert fp32["out_gap"] < 1e-5 * max(1.0, fp32["out_scale"]) and fp32["k_gap"] < 1e-5, fp32
    assert fp32["v_gap"] < 1e-5 * max(1.0, fp32["v_scale"]), fp32
    assert bf16["out_gap"] < 0.03 * bf16["out_scale"], bf16  # a few ulps after o_proj and the MLP
    assert bf16["k_gap"] <= 2**-6 * bf16["k_scale"], bf16  # <= 2 ulps of the largest key
    assert bf16["v_gap"] <= 2**-7 * bf16["v_scale"], bf16  # <= 1 ulp of the largest value


if __name__ == "__main__":
    for dt in (torch.float32, torch.bfloat16):
        print(json.dumps(compare(sys.argv[1], dt)))
