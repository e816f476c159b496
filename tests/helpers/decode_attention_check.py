"""Shared by the fused decode-attention tests (CPU interpreter and CUDA): one decode layer
of a random model through `decode_layer` (torch ops) and `decode_layer_fused` (the Triton
kernel), from the same cache contents, with positions spread over several key blocks, in the
model dtype and with an FP8 cache (`compare(..., fp8=True)`: scales unlike 1 and unlike from
head to head, one head's saturating); the kernel alone on an FP8 cache against torch's
`quantize_fp8` / `dequantize_fp8` byte for byte (`compare_fp8_kernel`: saturation, values below
e4m3's normal range, ties); and greedy engines on an FP8 cache, fused against torch attention
(`engine_fp8`).

Run as a script (`python -m tests.helpers.decode_attention_check DEVICE`), it prints one
JSON line per comparison: the largest gaps of the layer outputs and of the two caches (fp32,
bf16; then the same with an FP8 cache), the kernel's FP8 bytes (fp32, bf16, fp16), the
engines'; `check_gaps`, `check_fp8_gaps`, `check_fp8_kernel` and `check_engine_fp8` hold the
tolerances both tiers assert."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import torch

from rl_core.generation.native import decode_attention
from rl_core.generation.native.fused_stack import decode_layer_fused
from rl_core.generation.native.kv_cache import FP8_E4M3_MAX, KVCache, dequantize_fp8, quantize_fp8
from rl_core.generation.native.model import CausalLM, ModelSpec, attention_input, decode_layer


@contextmanager
def large_step_tile():
    """The kernel at `decode_attention.TILE` (the tile of steps above `SMALL_ROWS` rows) whatever the
    rows: the tests' few rows would otherwise take `TILE_SMALL` only."""
    small = decode_attention.SMALL_ROWS
    decode_attention.SMALL_ROWS = 0
    try:
        yield
    finally:
        decode_attention.SMALL_ROWS = small


def compare(device: str, dtype: torch.dtype, heads: int = 8, kv_heads: int = 2, head_dim: int = 16,
            positions: tuple[int, ...] = (0, 1, 63, 64, 65, 130, 199), seed: int = 0, fp8: bool = False) -> dict:
    """Largest |torch - fused| of the layer output and of the key/value caches after the step,
    and the largest |output| (the scale of the gaps). With `fp8` both caches are FP8 under the
    same scales (`_fp8_scales`), the fused layer's QKV projection is F.linear as the torch
    layer's (so both quantize the same values), and the row adds the FP8 bytes (`_byte_gaps`)."""
    torch.manual_seed(seed)
    hidden = heads * head_dim
    spec = ModelSpec("qwen2", 50, hidden, 1, heads, kv_heads, head_dim, 2 * hidden, 1e-6, 10000.0, 256, True, False,
                     False, True, (1,))
    model = CausalLM(spec, 256, device, dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    storage = "fp8_e4m3" if fp8 else "auto"
    caches = [KVCache(1, len(positions) + 1, 256, kv_heads, head_dim, dtype=dtype, device=device, storage=storage)
              for _ in range(2)]
    if fp8:
        keys, values = torch.randn(caches[0].k.shape, device=device), torch.randn(caches[0].v.shape, device=device)
    else:
        keys, values = torch.randn_like(caches[0].k), torch.randn_like(caches[0].v)
    pos = torch.tensor(positions, device=device)
    n, key_len = len(positions), max(positions) + 1
    x = torch.randn(n, hidden, dtype=dtype, device=device)
    weights = model.decode_weights()[0]
    scales = (None, None)
    if fp8:
        qkv = attention_input(x, weights[0], weights[1], weights[2], 1e-6).view(n, heads + 2 * kv_heads, head_dim)
        scales = _fp8_scales(qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:])
        keys, values = (keys * scales[0][:, None, None] * 100).to(dtype), (values * scales[1][:, None, None] * 100).to(dtype)
    for c in caches:
        if fp8:
            c.set_scales(scales[0][None], scales[1][None], requantize=False)
            c.k[0].copy_(quantize_fp8(keys[0].transpose(1, 2), scales[0]).transpose(1, 2))
            c.v[0].copy_(quantize_fp8(values[0].transpose(1, 2), scales[1]).transpose(1, 2))
        else:
            c.k.copy_(keys)
            c.v.copy_(values)
    cos, sin = model._cos[pos].unsqueeze(1), model._sin[pos].unsqueeze(1)
    slots = torch.arange(n, device=device)
    masked = torch.arange(key_len, device=device)[None, :] > pos[:, None]
    args = (x, cos, sin, slots, pos, masked, weights)
    kw = dict(heads=heads, kv_heads=kv_heads, eps=1e-6)
    want = decode_layer(*args, caches[0].k[0], caches[0].v[0], *caches[0].layer_scales(0), **kw)
    got = decode_layer_fused(*args, caches[1].k[0], caches[1].v[0], *caches[1].layer_scales(0), **kw,
                             **({"split_k": False} if fp8 else {}))
    gap = lambda a, b: (a.float() - b.float()).abs().max().item()  # noqa: E731
    read = [c.slot_range(0, n + 1, 256) for c in caches]  # [n + 1, kv_heads, 256, D] each, in dtype
    row = {"dtype": str(dtype), "out_gap": gap(want, got), "out_scale": want.float().abs().max().item(),
           "k_gap": gap(read[0][0], read[1][0]), "k_scale": read[0][0].float().abs().max().item(),
           "v_gap": gap(read[0][1], read[1][1]), "v_scale": read[0][1].float().abs().max().item()}
    if fp8:
        row.update(fp8=True, written=n * kv_heads * head_dim, **_byte_gaps("k", caches[0].k, caches[1].k),
                   **_byte_gaps("v", caches[0].v, caches[1].v),
                   saturated=int((caches[0].k.view(torch.uint8) & 0x7F == 0x7E).sum()
                                 + (caches[0].v.view(torch.uint8) & 0x7F == 0x7E).sum()))
    return row


def _fp8_scales(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales [kv_heads] for new keys/values k, v [S, kv_heads, D]: their amax / 448 times 3, 0.5, 1.7,
    2.3, ... by kv head (the values' factors rolled by one head), so unlike 1 and unlike from head to
    head; a head with factor 0.5 saturates (|x / scale| up to 896 before the clamp to 448)."""
    factors = torch.tensor([3.0, 0.5, 1.7, 2.3, 0.5, 4.0, 1.1, 0.5], device=k.device)[:k.shape[1]]
    amax = lambda t: t.float().abs().amax(dim=(0, 2)).clamp_min(1e-3)  # noqa: E731
    return amax(k) / FP8_E4M3_MAX * factors, amax(v) / FP8_E4M3_MAX * factors.roll(1)


def _byte_gaps(name: str, a: torch.Tensor, b: torch.Tensor) -> dict:
    """How many FP8 bytes of two caches differ, and by how many e4m3 steps at most (codes in value
    order: sign times the 7-bit magnitude code)."""
    order = lambda t: (t.view(torch.uint8).long() & 0x7F) * (1 - 2 * (t.view(torch.uint8).long() >> 7))  # noqa: E731
    return {f"{name}_bytes": int((a.view(torch.uint8) != b.view(torch.uint8)).sum()),
            f"{name}_steps": int((order(a) - order(b)).abs().max())}


def compare_fp8_kernel(device: str, dtype: torch.dtype, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
                       positions: tuple[int, ...] = (0, 1, 63, 64, 130), seed: int = 0) -> dict:
    """`rope_store_attend` on an FP8 cache against torch: the written bytes against `quantize_fp8` of the
    rotated key / the value (the rotation in float32 rounded once to `dtype`, as the kernel does),
    and the output against float64 attention over `dequantize_fp8` of the expected cache. Slot 0
    (position 0: cos 1, sin 0, so its key is not rotated) holds values that saturate, values below
    e4m3's normal range (2^-6 x scale) and ties (halfway between two e4m3 values, under a power-of-two
    scale: kv head 0's)."""
    from rl_core.generation.native.decode_attention import rope_store_attend

    gen = torch.Generator().manual_seed(seed)
    n, slots, length = len(positions), len(positions) + 1, 160
    pos = torch.tensor(positions)
    qkv = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=gen)
    k_scale = torch.tensor([2.0 ** -6] + [0.013 * (h + 1) for h in range(1, kv_heads)])
    v_scale = torch.tensor([2.0 ** -6] + [0.021 / (h + 1) for h in range(1, kv_heads)])
    # x / scale halfway between two e4m3 values (to even: 1.0, 1.25, -1.0, -1.25, 2.5, 2^-4, 2^-8, -0.0)
    ties = torch.tensor([1.0625, 1.1875, -1.0625, -1.1875, 2.375, 0.06640625, 2.5 * 2 ** -9, -0.5 * 2 ** -9]) * 2.0 ** -6
    for part in (heads, heads + kv_heads):  # slot 0, kv head 0: its key (not rotated) and its value
        qkv[0, part, :8] = ties
        qkv[0, part, 8:12] = torch.tensor([100.0, -100.0, 1e-5, -1e-5])  # saturating; below 2^-9 x scale
        qkv[0, part + 1, :2] = torch.tensor([60.0, -60.0])  # kv head 1: saturating
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    angles = (pos[:, None].double() * inv[None, :]).repeat(1, 2)
    half = head_dim // 2
    cos = angles.cos().to(dtype)
    sin = torch.cat([-angles.sin()[:, :half], angles.sin()[:, half:]], dim=-1).to(dtype)
    qkv = qkv.to(dtype)
    cache_shape = (slots, kv_heads, length, head_dim)
    k8 = quantize_fp8(torch.randn(cache_shape, generator=gen).transpose(1, 2), k_scale).transpose(1, 2).contiguous()
    v8 = quantize_fp8(torch.randn(cache_shape, generator=gen).transpose(1, 2), v_scale).transpose(1, 2).contiguous()
    rotate = lambda t: (t.float() * cos[:, None].float() + t.float().roll(half, -1) * sin[:, None].float()).to(dtype)  # noqa: E731
    q, k = rotate(qkv[:, :heads]), rotate(qkv[:, heads:heads + kv_heads])
    want_k, want_v = k8.clone(), v8.clone()
    rows = torch.arange(n)
    want_k.view(torch.uint8)[rows, :, pos] = quantize_fp8(k, k_scale).view(torch.uint8)
    want_v.view(torch.uint8)[rows, :, pos] = quantize_fp8(qkv[:, heads + kv_heads:], v_scale).view(torch.uint8)
    got_k, got_v = k8.to(device), v8.to(device)
    out = rope_store_attend(qkv.to(device), cos.to(device), sin.to(device), pos.to(device), got_k, got_v, heads,
                            kv_heads, k_scale=k_scale.to(device), v_scale=v_scale.to(device)).cpu()
    keys, values = (dequantize_fp8(t, s, dtype).double() for t, s in ((want_k, k_scale), (want_v, v_scale)))
    group = heads // kv_heads
    ref = torch.empty(n, heads * head_dim, dtype=torch.float64)
    for s, p in enumerate(positions):
        scores = torch.einsum("kgd,kld->kgl", q[s].double().view(kv_heads, group, head_dim), keys[s, :, :p + 1])
        ref[s] = torch.einsum("kgl,kld->kgd", (scores * head_dim ** -0.5).softmax(-1), values[s, :, :p + 1]).flatten()
    written_k, written_v = want_k.view(torch.uint8)[rows, :, pos], want_v.view(torch.uint8)[rows, :, pos]
    return {"dtype": str(dtype), "fp8_kernel": True, "written": n * kv_heads * head_dim,
            **_byte_gaps("k", want_k, got_k.cpu()), **_byte_gaps("v", want_v, got_v.cpu()),
            "saturated": int((written_k & 0x7F == 0x7E).sum() + (written_v & 0x7F == 0x7E).sum()),
            "below_normal": int((written_k & 0x78 == 0).sum() + (written_v & 0x78 == 0).sum()),
            "out_gap": (out.double() - ref).abs().max().item(), "out_scale": ref.abs().max().item()}


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


def check_fp8_gaps(rows: list[dict]) -> None:
    """An FP8 cache, fp32 and bf16 rows of `compare(..., fp8=True)`: both layers quantize the same
    values, the values exactly (no rotation) and so byte for byte; the keys after RoPE, which the
    fused kernel rounds once and the torch layer after each op, so a key may be stored one e4m3
    step apart (several steps below e4m3's normal range, where a rotation's cancellation leaves
    the roundings' difference larger than a step): in float32 rarely (a fused multiply-add on
    CUDA: at most 1 in 100 written, one step), in bf16 where the two bf16 roundings part near an
    e4m3 rounding boundary (at most 1 in 6 written, none further off than one e4m3 step of the
    largest key; 7.6% at head_dim 128 in Triton's interpreter, whose float32 -> bf16 rounds toward
    zero). The outputs: float32 to rounding when every byte agrees (the same keys and values read
    back); bf16 within twice `check_gaps`' tolerance (some keys an e4m3 step, not a bf16 ulp, apart)."""
    fp32, bf16 = rows
    for row in rows:
        assert row["fp8"] and row["saturated"] > 0 and row["v_bytes"] == 0 and row["v_gap"] == 0, row
    assert fp32["k_bytes"] <= fp32["written"] // 100 and fp32["k_steps"] <= 1, fp32
    assert fp32["out_gap"] < (1e-5 if fp32["k_bytes"] == 0 else 1e-2) * max(1.0, fp32["out_scale"]), fp32
    assert bf16["k_bytes"] <= bf16["written"] // 6 and bf16["k_gap"] <= 2 ** -3 * bf16["k_scale"], bf16
    assert bf16["out_gap"] < 0.06 * bf16["out_scale"], bf16


def check_fp8_kernel(rows: list[dict]) -> None:
    """`compare_fp8_kernel` rows (fp32, bf16, fp16): the values' bytes are `quantize_fp8`'s, with
    saturation, values below the normal range and ties among them; the keys' bytes too, except
    where the rotation rounds otherwise than torch's float32 ops (Triton's interpreter rounds
    float32 -> bf16 toward zero; on CUDA float32 a fused multiply-add): there one e4m3 step at most,
    in at most 1 in 10 written. The output is float64 attention over the dequantized cache up to
    float32 rounding (fp32), a few units of the dtype's last place (bf16 / fp16)."""
    for row in rows:
        assert row["v_bytes"] == 0 and row["k_steps"] <= 1 and row["k_bytes"] <= row["written"] // 10, row
        assert row["saturated"] >= 6 and row["below_normal"] >= 6, row
        ulp = {"torch.float32": 1e-5, "torch.bfloat16": 2 ** -5, "torch.float16": 2 ** -8}[row["dtype"]]
        assert row["out_gap"] <= ulp * max(1.0, row["out_scale"]), row
    assert rows[2]["k_bytes"] == 0, rows[2]  # float16: the products and roundings are exact on both sides


def engine_fp8(device: str, dtype: torch.dtype = torch.float32, **options) -> dict:
    """Greedy tokens and logprobs of two engines on an FP8 KV cache (scales calibrated by the engine,
    one per layer and kv head): `decode_attention` torch against fused, on the static path (the
    interpreter) or with `options` (e.g. CUDA graphs). Whether the tokens are the same, the
    largest logprob gap, and the engines' scales (equal, and not all 1)."""
    from rl_core.types import GenerationRequest, SamplingParams
    from tests.helpers.engine_models import make_engine, prompts, run, tiny_model

    model = tiny_model("qwen2", 0, 0.1, max_positions=64).to(device, dtype)  # 0.1: FP8 keys resolve its attention
    reqs = [GenerationRequest(str(i), p, SamplingParams(greedy=True, max_tokens=6 + i)) for i, p in
            enumerate(prompts(5, seed=3))]
    kw = dict(device=device, dtype=dtype, decode_path="static", max_batch_size=4, kv_cache_dtype="fp8_e4m3") | options
    ref_engine, engine = make_engine(model, **kw), make_engine(model, decode_attention="fused", **kw)
    assert engine.decoder.fused_attention and engine.cache.fp8 and ref_engine.cache.fp8
    ref, got = run(ref_engine, reqs), run(engine, reqs)
    scales = torch.stack([engine.cache.k_scale, engine.cache.v_scale]).cpu()
    return {"same_tokens": all(got[r.request_id].token_ids == ref[r.request_id].token_ids for r in reqs),
            "tokens": sum(len(ref[r.request_id].token_ids) for r in reqs),
            "logprob_gap": max(abs(a - b) for r in reqs for a, b in
                               zip(got[r.request_id].logprobs, ref[r.request_id].logprobs)),
            "same_scales": bool(torch.equal(scales, torch.stack([ref_engine.cache.k_scale,
                                                                 ref_engine.cache.v_scale]).cpu())),
            "scales_distinct": len(set(scales.flatten().tolist()))}


def check_engine_fp8(row: dict, dtype: torch.dtype = torch.float32) -> None:
    """The fused engine's greedy tokens are the torch engine's (float32; bf16 may part where two
    logits tie within bf16 rounding), its logprobs within float rounding of them."""
    assert row["same_scales"] and row["scales_distinct"] > 2 and row["tokens"] >= 20, row
    if dtype == torch.float32:
        assert row["same_tokens"] and row["logprob_gap"] < 1e-4, row


if __name__ == "__main__":
    for dt in (torch.float32, torch.bfloat16):
        print(json.dumps(compare(sys.argv[1], dt)))
    with large_step_tile():
        for dt in (torch.float32, torch.bfloat16):
            print(json.dumps(compare(sys.argv[1], dt)))
    for dt in (torch.float32, torch.bfloat16):
        print(json.dumps(compare(sys.argv[1], dt, fp8=True)))
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        print(json.dumps(compare_fp8_kernel(sys.argv[1], dt)))
    print(json.dumps({"engine_fp8": engine_fp8(sys.argv[1])}))
