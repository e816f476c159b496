"""A fused decode-attention step for the static/graph decode path: RoPE, cache write and
attention of one new token per slot in one Triton kernel.

Owns: `rope_store_attend` (its docstring gives the algorithm and the roundings), which
replaces what `decode_layer` runs between the QKV and the output projection (the RoPE and
cache-write kernels, the key/value range read, two batched matmuls, the mask and the
softmax); the FP8 cache path (`kv_cache_dtype: fp8_e4m3`: the layer's scales read from
device memory at each launch, keys and values read at 1 byte each); its launch tiles
(`TILE`, `TILE_SMALL`); and `check_supported`: a CUDA device (or Triton's interpreter,
`TRITON_INTERPRET=1`, in the CPU tests), a power-of-two head_dim >= 16, float32 / bfloat16 /
float16, the cache in the model dtype or FP8 e4m3 (compute capability 8.9+), row s = slot s.

Does not own: the projections, norms and MLP (model.py), Triton's import (triton_support.py),
the cache (kv_cache.py), when it is used (decode_graph.py). Read more: docs/generation.md.
"""

from __future__ import annotations

import torch

from rl_core.generation.native.triton_support import gdc_launch_dependents, gdc_wait, interpreting, pdl_flags, tl, triton

# The kernel's launch: (keys per inner step, warps, pipeline stages). Timed side by side
# (bench/decode_kernels_gpu.py): no tile of `TILES` beat (64, 4, 3) at 256 slots, so the kernel is
# not autotuned. Splitting a slot's keys over several programs with a merge kernel (Flash-Decoding's
# split-KV) was slower at every row count: not kept (docs/generation.md, "What we learned").
TILE = (64, 4, 3)
# Steps of up to SMALL_ROWS slots take TILE_SMALL instead: fewer, longer programs read their keys in
# 128-key tiles, which pays on long rollouts at small batches (bench/generation_gpu.py --tile64) and
# gains nothing from 128 slots on. Only where a 128-key tile in the model dtype holds no more bytes
# than at the measured shape (head_dim 64, bf16: SMALL_TILE_BYTES, 16 KB): larger ones (head_dim 128,
# float32) take TILE (there the 128-key tile's pipeline does not fit in shared memory). Module values,
# read at each launch (so fixed into a captured graph): benchmarks set SMALL_ROWS to 0 to compare.
TILE_SMALL = (128, 4, 3)
SMALL_ROWS = 64
SMALL_TILE_BYTES = 128 * 64 * 2
TILES = [(64, 4, 3), (64, 4, 2), (128, 4, 3), (128, 8, 3), (32, 4, 3), (32, 2, 3), (64, 2, 3), (128, 4, 2)]


def check_supported(device: torch.device, dtype: torch.dtype, head_dim: int, fp8_cache: bool) -> str | None:
    """None when the fused kernel can run this model and cache; else why not (one sentence)."""
    if triton is None:
        return "the triton package is not installed (it comes with CUDA builds of torch)"
    if device.type != "cuda" and not interpreting():
        return f"it runs on a CUDA device (the cache is on {device})"
    if fp8_cache and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return (f"with kv_cache_dtype fp8_e4m3 it needs compute capability 8.9+ (Triton's e4m3 type; this GPU is "
                f"{major}.{minor})")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"it runs float32, bfloat16 or float16 models (this one is {dtype})"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"it needs a power-of-two head_dim of at least 16 (this model's is {head_dim})"
    return None


if triton is not None:

    @triton.jit
    def _e4m3(y):
        """float32 y -> float8_e4m3fn as `kv_cache.quantize_fp8` rounds it (clamp to +-448, round to
        nearest even). The rounding to the e4m3 grid is done here in float32 arithmetic, the same
        code compiled and interpreted, and the cast after it only converts grid values, which is
        exact on both: Triton's interpreter rounds float32 -> e4m3 its own way (triton 3.7: 3016
        of 16384 random values off torch's, most below 2^-6)."""
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        a = tl.abs(y)
        # The e4m3 step at |y|: 2^(e-3) for the exponent e of |y| (at least -6, the subnormal step 2^-9).
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        step = ((e + 124) << 23).to(tl.float32, bitcast=True)
        inverse = ((130 - e) << 23).to(tl.float32, bitcast=True)
        # a / step is below 16; adding and taking away 2^23 rounds it to an integer, to nearest even
        # (float32 addition's rounding), and the products with powers of two are exact. The sign
        # goes back on by a product, so that -0.0 and negatives rounding to 0 keep it (Triton's
        # negation is 0 - x, which gives +0.0).
        r = ((a * inverse + 8388608.0) - 8388608.0) * step
        return (r * tl.where(y.to(tl.int32, bitcast=True) < 0, -1.0, 1.0)).to(tl.float8e4nv)

    @triton.jit
    def _rope_store_attend_kernel(qkv, cos, sin, positions, k_cache, v_cache, out, k_scale, v_scale,
                                  stride_qkv_row, stride_qkv_head, stride_rope_row,
                                  stride_cache_slot, stride_cache_head, stride_cache_pos, stride_out_row,
                                  scale,
                                  HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                                  BLOCK_GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                                  FP8: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        slot = tl.program_id(0)
        kv_head = tl.program_id(1)
        if PDL:  # launched while the QKV projection finishes: wait for it before any load or store
            gdc_wait()
        pos = tl.load(positions + slot)
        d = tl.arange(0, DIM)
        d_rot = (d + DIM // 2) % DIM  # roll by D/2: rotate_half up to the sign held by `sin`
        g = tl.arange(0, BLOCK_GROUP)
        in_group = g < GROUP
        cos_row = tl.load(cos + slot * stride_rope_row + d).to(tl.float32)
        sin_row = tl.load(sin + slot * stride_rope_row + d).to(tl.float32)
        row = qkv + slot * stride_qkv_row
        # Query heads kv_head*GROUP .. +GROUP-1 (HF's repeat_kv order), rotated.
        q_ptr = row + (kv_head * GROUP + g)[:, None] * stride_qkv_head
        q = tl.load(q_ptr + d[None, :], mask=in_group[:, None], other=0.0).to(tl.float32)
        q_half = tl.load(q_ptr + d_rot[None, :], mask=in_group[:, None], other=0.0).to(tl.float32)
        k_ptr = row + (HEADS + kv_head) * stride_qkv_head
        k_new = tl.load(k_ptr + d).to(tl.float32) * cos_row + tl.load(k_ptr + d_rot).to(tl.float32) * sin_row
        # In the model dtype (out's, qkv's): the cache's too unless it is FP8 (rope_store_attend checks).
        dtype = out.dtype.element_ty
        q = (q * cos_row[None, :] + q_half * sin_row[None, :]).to(dtype)
        k_new = k_new.to(dtype)
        v_new = tl.load(row + (HEADS + KV_HEADS + kv_head) * stride_qkv_head + d).to(dtype)
        base = slot * stride_cache_slot + kv_head * stride_cache_head
        if FP8:
            # Stored: e4m3(x / scale) of the rotated key and the value in the model dtype; attended:
            # what the torch step reads back, e4m3 -> dtype times the scale in dtype, the product
            # rounded to dtype (exact in float32 first: 4 by <= 11 significant bits).
            k_sc = tl.load(k_scale + kv_head)
            v_sc = tl.load(v_scale + kv_head)
            k_mul = k_sc.to(dtype).to(tl.float32)
            v_mul = v_sc.to(dtype).to(tl.float32)
            k_q = _e4m3(tl.math.div_rn(k_new.to(tl.float32), k_sc))
            v_q = _e4m3(tl.math.div_rn(v_new.to(tl.float32), v_sc))
            tl.store(k_cache + base + pos * stride_cache_pos + d, k_q)
            tl.store(v_cache + base + pos * stride_cache_pos + d, v_q)
            k_new = (k_q.to(tl.float32) * k_mul).to(dtype)
            v_new = (v_q.to(tl.float32) * v_mul).to(dtype)
        else:
            tl.store(k_cache + base + pos * stride_cache_pos + d, k_new)
            tl.store(v_cache + base + pos * stride_cache_pos + d, v_new)

        m_i = tl.full([BLOCK_GROUP], -1.0e30, tl.float32)  # running max (finite: no inf - inf)
        l_i = tl.zeros([BLOCK_GROUP], tl.float32)  # running sum of exp(score - m_i)
        acc = tl.zeros([BLOCK_GROUP, DIM], tl.float32)
        for start in range(0, pos, BLOCK_N):  # the cached keys 0..pos-1
            n = start + tl.arange(0, BLOCK_N)
            valid = n < pos
            offs = base + n[:, None] * stride_cache_pos + d[None, :]
            k = tl.load(k_cache + offs, mask=valid[:, None], other=0.0)
            v = tl.load(v_cache + offs, mask=valid[:, None], other=0.0)
            if FP8:
                k = (k.to(tl.float32) * k_mul).to(dtype)
                v = (v.to(tl.float32) * v_mul).to(dtype)
            if IEEE:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if PDL:
            gdc_launch_dependents()
        # The new token's own key and value (position pos), from registers.
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
        m_new = tl.maximum(m_i, s_new)
        alpha = tl.exp(m_i - m_new)
        p_new = tl.exp(s_new - m_new)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
        result = acc / l_i[:, None]
        o_ptr = out + slot * stride_out_row + (kv_head * GROUP + g)[:, None] * DIM + d[None, :]
        tl.store(o_ptr, result.to(out.dtype.element_ty), mask=in_group[:, None])


def rope_store_attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
                      tile: tuple[int, int, int] | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [S, heads + 2 kv_heads, D] (the QKV projection of one token per slot, biases
    added), cos/sin [S, 1, D] or [S, D] (RoPE rows of each slot's position, `sin` signed as
    in `CausalLM._rope_tables`), positions [S] long, one layer's k/v cache [slots >= S,
    kv_heads, L, D] (updated in place at (s, positions[s])). Returns the attention output
    [S, heads * D] in qkv's dtype. `tile` = (keys per inner step, warps, pipeline stages),
    default `TILE_SMALL` up to `SMALL_ROWS` rows (where its key tile is at most `SMALL_TILE_BYTES`) and
    `TILE` otherwise, is for benchmarks. An FP8 cache (float8_e4m3fn, `KVCache(storage="fp8_e4m3")`)
    takes the layer's float32 scales `k_scale` / `v_scale` [kv_heads] (`KVCache.layer_scales`),
    read by the kernel from device memory at each launch (so a captured graph follows
    `set_scales`); a cache in qkv's dtype takes none.

    Per slot s: (1) rotate the token's query heads and key head by RoPE (Su et al. 2021,
    "RoFormer"; rotate_half as a roll by D/2, the sign folded into `sin`, as `model.decode_layer`);
    (2) write the rotated key and the value into the cache at (s, positions[s]); (3) attend over
    the cached keys 0..positions[s]-1 and the new key kept in registers (nothing reads what the
    kernel writes), online softmax in float32 (FlashAttention, Dao et al. 2022, in its decode
    form as Flash-Decoding, Dao et al. 2023), grouped-query heads sharing one read of their KV
    head (Ainslie et al. 2023). Keys are read only up to each slot's own position. Results equal
    the unfused step to float rounding (scores accumulate in float32 where the unfused bf16 step
    rounds them to bf16). With an FP8 cache the key and value are stored as
    `kv_cache.quantize_fp8` stores them (x / scale in float32, clamped to +-448, nearest-even
    e4m3: the same bytes) and read back as `kv_cache.dequantize_fp8` reads them, the scales
    applied per element (not folded into the scores), so both paths see the same keys."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 != (k_scale is not None) or (k_scale is None) != (v_scale is None) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"rope_store_attend: a {k_cache.dtype} key cache and a {v_cache.dtype} value cache with "
                         f"k_scale {'given' if k_scale is not None else 'None'} and v_scale "
                         f"{'given' if v_scale is not None else 'None'}; expected both caches float8_e4m3fn with "
                         f"both scales, or both in qkv's dtype ({qkv.dtype}) with neither.")
    if fp8 and (k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32
                or k_scale.shape != (kv_heads,) or v_scale.shape != (kv_heads,)
                or k_scale.stride(0) != 1 or v_scale.stride(0) != 1):
        raise ValueError(f"rope_store_attend: k_scale / v_scale are {k_scale.dtype} {tuple(k_scale.shape)} / "
                         f"{v_scale.dtype} {tuple(v_scale.shape)}; expected contiguous float32 [{kv_heads}] "
                         "(one layer's KVCache.layer_scales).")
    if not fp8 and k_cache.dtype != qkv.dtype:
        raise ValueError(f"rope_store_attend: the cache is {k_cache.dtype} and qkv {qkv.dtype}; expected the "
                         "cache in qkv's dtype, or float8_e4m3fn with its scales.")
    rows, _, dim = qkv.shape
    group = heads // kv_heads
    qkv = qkv.contiguous()
    cos, sin = cos.reshape(rows, dim), sin.reshape(rows, dim)
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or sin.stride(0) != cos.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("rope_store_attend needs key and value caches of one layout, contiguous in head_dim")
    out = qkv.new_empty(rows, heads * dim)
    if rows == 0:
        return out
    small = rows <= SMALL_ROWS and TILE_SMALL[0] * dim * qkv.element_size() <= SMALL_TILE_BYTES
    block_n, warps, stages = tile or (TILE_SMALL if small else TILE)
    _rope_store_attend_kernel[(rows, kv_heads)](
        qkv, cos, sin, positions, k_cache, v_cache, out, k_scale, v_scale,
        qkv.stride(0), qkv.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0),
        dim ** -0.5,
        HEADS=heads, KV_HEADS=kv_heads, GROUP=group, BLOCK_GROUP=max(16, triton.next_power_of_2(group)),
        DIM=dim, BLOCK_N=block_n, FP8=fp8, IEEE=qkv.dtype == torch.float32 or interpreting(), num_warps=warps,
        num_stages=stages, **pdl_flags(qkv))
    return out
