"""The SwiGLU MLP's first half as one Triton kernel for the static/graph decode step.

Owns: `gate_up_silu(x, gate_up_weight, gate_up_bias)` = silu(x @ Wg^T + bg) * (x @ Wu^T + bu)
for x [S, hidden] and the fused [2 m, hidden] gate/up weight of `model.MLP` (gate rows
first): one kernel computes both projections of an output tile (one pass over x, each
weight row read once per row block) and applies SiLU and the product in its epilogue, so
the [S, 2 m] projection never goes to memory and the separate SiLU-gate kernel is gone
(SwiGLU: Shazeer 2020, "GLU Variants Improve Transformer"). The roundings are the eager
step's: each projection rounded to the model dtype (bias added first), SiLU computed in
float32 and rounded, the product rounded; the projections themselves are accumulated in
float32 in a different order than cuBLAS, so results equal `model.attention_output_mlp`'s
to float rounding (bit-exact in float32 up to summation order).

Where it runs: `generation.native.decode_mlp: fused` (CUDA, or Triton's CPU interpreter
in the tests; the same limits as `decode_attention.check_supported` for device and dtype).

A down projection + residual kernel in the same style was tried and dropped: on the H200 it
was slower than cuBLAS's split-K matmul (docs/generation.md).

Does not own: the output and down projections and the norms (model.py, compiled by the decode runner),
when the kernels are used (decode_graph.py), Triton's import (triton_support.py).
"""

from __future__ import annotations

import torch

from rl_core.generation.native import triton_support
from rl_core.generation.native.triton_support import (descriptor, gdc_launch_dependents, gdc_wait, interpreting, pdl_flags, tl,
                                                      tma_usable, triton)

# Tile sizes tried on CUDA in bf16/fp16, autotuned on the first call per (row class, m, hidden),
# i.e. in the decode runner's warm-up before a graph is captured. The H200 picked (128, 64, 64)
# at 256 rows and (64, 64, 128) at 64 (bench/decode_kernels_gpu.py); the row class (a power of
# two, 16..256) keeps the autotuning to a few runs instead of one per slot bucket. The last one,
# (64, 64, 64) with 4 warps, was the fastest of 94 tiles at 256 rows in the bench's `--sweep`
# (13.5 us against 15.3 us for (128, 64, 64, 8, 3), the Qwen2.5-0.5B shape; 2026-12-03).
_CUDA_CONFIGS = [(128, 64, 64, 8, 3), (64, 64, 128, 4, 3), (256, 32, 64, 8, 3), (128, 128, 64, 8, 3),
                 (32, 64, 128, 4, 3), (16, 64, 128, 4, 4), (64, 64, 64, 4, 3)]
_FIXED = (16, 32, 32)  # float32 (the exact path: IEEE dots) and Triton's CPU interpreter: no autotuning

if triton is not None:

    @triton.jit
    def _gate_up_silu_kernel(x, w, bias, out, rows, row_class, m, hidden, stride_x, stride_w, stride_out,
                             HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BF16_BITS: tl.constexpr,
                             BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        row_ok = r < rows
        col_ok = c < m
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + kk
            k_ok = k < hidden
            a = tl.load(x + r[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wmask = k_ok[:, None] & col_ok[None, :]
            wg = tl.load(w + c[None, :] * stride_w + k[:, None], mask=wmask, other=0.0)  # [K, N]: gate rows
            wu = tl.load(w + (c + m)[None, :] * stride_w + k[:, None], mask=wmask, other=0.0)  # up rows
            if IEEE:
                acc_g += tl.dot(a.to(tl.float32), wg.to(tl.float32), input_precision="ieee")
                acc_u += tl.dot(a.to(tl.float32), wu.to(tl.float32), input_precision="ieee")
            else:
                acc_g = tl.dot(a, wg, acc_g)
                acc_u = tl.dot(a, wu, acc_u)
        if HAS_BIAS:
            acc_g += tl.load(bias + c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(bias + m + c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        dtype = out.dtype.element_ty
        g = rounded(acc_g, dtype, BF16_BITS)
        u = rounded(acc_u, dtype, BF16_BITS)
        s = rounded(g / (1.0 + tl.exp(-g)), dtype, BF16_BITS)  # F.silu: float32 inside, rounded
        tl.store(out + r[:, None] * stride_out + c[None, :], rounded(s * u, dtype, BF16_BITS).to(dtype),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def rounded(x, dtype: tl.constexpr, BF16_BITS: tl.constexpr):
        """x (float32) rounded to `dtype`, as float32. BF16_BITS: round to nearest even by
        integer arithmetic (Triton's CPU interpreter truncates float32 -> bfloat16 casts)."""
        if BF16_BITS:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(dtype).to(tl.float32)

    @triton.jit
    def _gate_up_silu_tma_kernel(x_desc, gate_desc, up_desc, bias, out, rows, m, hidden, stride_out,
                                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
                                 ROWS_FIRST: tl.constexpr):
        """`_gate_up_silu_kernel` (bf16/fp16) with its tiles loaded through TMA descriptors: x, the
        gate rows and the up rows each their own descriptor (reads past the rows or the gate rows
        give zeros, so only the store is masked). PDL: launched while the kernel before finishes
        (triton_support.pdl), it waits for that kernel before any load or store."""
        if PDL:
            gdc_wait()
        off_n = tl.program_id(1 if ROWS_FIRST else 0) * BLOCK_N
        off_m = tl.program_id(0 if ROWS_FIRST else 1) * BLOCK_M
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):
            a = x_desc.load([off_m, k])
            acc_g = tl.dot(a, gate_desc.load([off_n, k]).T, acc_g)
            acc_u = tl.dot(a, up_desc.load([off_n, k]).T, acc_u)
        if PDL:
            gdc_launch_dependents()
        r = off_m + tl.arange(0, BLOCK_M)
        c = off_n + tl.arange(0, BLOCK_N)
        col_ok = c < m
        if HAS_BIAS:
            acc_g += tl.load(bias + c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(bias + m + c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        dtype = out.dtype.element_ty
        g = rounded(acc_g, dtype, False)
        s = rounded(g / (1.0 + tl.exp(-g)), dtype, False)  # F.silu: float32 inside, rounded
        tl.store(out + r[:, None] * stride_out + c[None, :], rounded(s * rounded(acc_u, dtype, False), dtype,
                                                                      False).to(dtype),
                 mask=(r < rows)[:, None] & col_ok[None, :])

    _gate_up_silu_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)
                 for bm, bn, bk, warps, stages in _CUDA_CONFIGS],
        key=["row_class", "m", "hidden"])(_gate_up_silu_kernel)


# The TMA kernel's tile (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for up to 64 rows and beyond: the
# fastest of 12 / 22 tiles on the H200 (bench/decode_kernels_gpu.py --parts tma, 2026-12-03): 5.50 us
# at 64 rows against 6.49 for the autotuned pointer kernel, 12.61 against 13.85 at 256. At 256 rows a
# later sweep with two pipeline stages and 128-row tiles (2026-12-04, 46 tiles) found (128, 64, 64, 4, 2)
# faster alone (12.37 against 12.90 / 12.94 us), but in the engine's decode step (CUDA graph, PDL) batch
# 256 took 1.44-1.45 ms with it against 1.30 ms with (64, 64, 64, 4, 3) (three processes each): not kept.
# Its programs are numbered row block first (`triton_support.ROWS_FIRST`): alone at 256 rows 10.15 against
# 12.77 us column block first (2026-12-04, the same tile), and the engine's decode step 1.27 / 1.28 against
# 1.31 ms at batch 256 (with split_k's partials in the same order). Triton's warp specialization
# (`tl.range(..., warp_specialize=True)`, triton 3.6) gave no gain at 8-warp tiles and wrong results
# at this 4-warp tile: not used.
TMA_TILES = {64: (64, 64, 128, 4, 4), 256: (64, 64, 64, 4, 3)}


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 tma: bool | None = None) -> torch.Tensor:
    """x [S, hidden], weight [2 m, hidden] (gate rows, then up rows), bias [2 m] or None;
    returns silu(gate) * up [S, m] in x's dtype, the roundings of the eager MLP. bf16/fp16 on a
    Hopper GPU load through TMA descriptors (`tma=None`); `tma=True` forces that kernel where
    descriptors work (the interpreter too: the tests), False the pointer kernel."""
    rows, hidden = x.shape
    m = weight.shape[0] // 2
    if weight.shape[1] != hidden or weight.stride(-1) != 1:
        raise ValueError(f"gate_up_silu needs a [2 m, {hidden}] weight contiguous in its last dimension; "
                         f"got {tuple(weight.shape)} with strides {weight.stride()}")
    x = x.contiguous()
    out = x.new_empty(rows, m)
    if rows == 0:
        return out
    ieee = x.dtype == torch.float32 or interpreting()
    gate, up = weight[:m], weight[m:]
    if (not ieee if tma is None else tma) and tma_usable(x, gate, up):
        bm, bn, bk, warps, stages = TMA_TILES[64 if rows <= 64 else 256] if not interpreting() else (*_FIXED, 4, 2)
        grid = (triton.cdiv(m, bn), triton.cdiv(rows, bm))
        if triton_support.ROWS_FIRST:
            grid = grid[::-1]
        _gate_up_silu_tma_kernel[grid](descriptor(x, [bm, bk]), descriptor(gate, [bn, bk]), descriptor(up, [bn, bk]),
                                       bias if bias is not None else x, out, rows, m, hidden, out.stride(0),
                                       HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages,
                                       ROWS_FIRST=triton_support.ROWS_FIRST, **pdl_flags(x),
                                       **({} if interpreting() else dict(num_warps=warps)))
        return out
    flags = dict(HAS_BIAS=bias is not None, IEEE=ieee, BF16_BITS=interpreting() and x.dtype == torch.bfloat16)
    row_class = min(max(16, 1 << (rows - 1).bit_length()), 256)  # only the autotuner's key
    args = (x, weight, bias if bias is not None else x, out, rows, row_class, m, hidden, x.stride(0),
            weight.stride(0), out.stride(0))
    if interpreting() or x.device.type != "cuda" or ieee:
        block = _FIXED
        grid = (triton.cdiv(m, block[1]), triton.cdiv(rows, block[0]))
        _gate_up_silu_kernel[grid](*args, **flags, BLOCK_M=block[0], BLOCK_N=block[1], BLOCK_K=block[2])
    else:
        def grid(meta):
            return triton.cdiv(m, meta["BLOCK_N"]), triton.cdiv(rows, meta["BLOCK_M"])

        _gate_up_silu_tuned[grid](*args, **flags)
    return out


def tuned_config() -> str | None:
    """The tile the CUDA autotuner picked last (for benchmarks); None without triton."""
    if triton is None:
        return None
    return str(getattr(_gate_up_silu_tuned, "best_config", None))
