"""The SwiGLU MLP's first half as one Triton kernel for the static/graph decode step.

Owns: `gate_up_silu(x, gate_up_weight, gate_up_bias)` = silu(x @ Wg^T + bg) * (x @ Wu^T + bu)
for x [S, hidden] and the fused [2 m, hidden] gate/up weight of `model.MLP` (gate rows
first), with the eager step's roundings (its docstring says how); the pointer kernel's
autotuned tiles and the TMA kernel's fixed tiles (`TMA_TILES`, Hopper). Where it runs:
`generation.native.decode_mlp: fused` (CUDA, or Triton's CPU interpreter in the tests; the
device and dtype limits of `decode_attention.check_supported`). A down projection + residual
kernel in the same style was slower than cuBLAS's split-K matmul and was dropped.

Does not own: the output and down projections and the norms (model.py, split_k.py, compiled by
the decode runner), when the kernels are used (decode_graph.py), Triton's import
(triton_support.py). Read more: docs/generation.md, "Decode paths and CUDA graphs".
"""

from __future__ import annotations

import torch

from rl_core.generation.native import triton_support
from rl_core.generation.native.triton_support import (descriptor, gdc_launch_dependents, gdc_wait, interpreting, pdl_flags, tl,
                                                      tma_usable, triton)

# Tile sizes tried on CUDA in bf16/fp16 by the pointer kernel, autotuned on the first call per
# (row class, m, hidden), i.e. in the decode runner's warm-up before a graph is captured; the row
# class (a power of two, 16..256) keeps the autotuning to a few runs instead of one per slot
# bucket. The last one came out fastest at 256 rows of the Qwen2.5-0.5B shape in
# `bench/decode_kernels_gpu.py --sweep`.
_CUDA_CONFIGS = [(128, 64, 64, 8, 3), (64, 64, 128, 4, 3), (256, 32, 64, 8, 3), (128, 128, 64, 8, 3),
                 (32, 64, 128, 4, 3), (16, 64, 128, 4, 4), (64, 64, 64, 4, 3)]
_FIXED = (16, 32, 32)  # float32 (the exact path: IEEE dots) and Triton's CPU interpreter: no autotuning

if triton is not None:

    @triton.jit
    def _gate_up_silu_kernel(x, w, bias, out, rows, row_class, m, hidden, stride_x, stride_w, stride_out,
                             HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BF16_BITS: tl.constexpr,
                             BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        r, c, kk, row_ok, col_ok = program_tile(rows, m, BLOCK_M, BLOCK_N, BLOCK_K)
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
    def program_tile(rows, cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The output tile of a pointer-load matmul program (program ids: column block, row block):
        its rows r and columns c, the offsets kk of one K block, and which rows and columns exist."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        return r, c, kk, r < rows, c < cols

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


# The TMA kernel's tile (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for up to 64 rows and beyond,
# picked by sweeps (bench/decode_kernels_gpu.py --parts tma; bench/split_k_cold_sweep.py --sweeps
# gate-up with the weight L2-cold, as a decode step reads it). A tile faster alone is kept only if
# the engine's decode step is faster with it too: a 128-row, two-stage tile that won alone made the
# step slower. Its programs are numbered row block first (`triton_support.ROWS_FIRST`), so programs
# sharing a weight tile run side by side. Triton's warp specialization (`tl.range(...,
# warp_specialize=True)`) gave no gain at 8-warp tiles and wrong results at this 4-warp tile: not used.
TMA_TILES = {64: (64, 64, 128, 4, 4), 256: (64, 64, 64, 4, 3)}


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 tma: bool | None = None) -> torch.Tensor:
    """x [S, hidden], weight [2 m, hidden] (gate rows, then up rows), bias [2 m] or None;
    returns silu(gate) * up [S, m] in x's dtype, the roundings of the eager MLP. bf16/fp16 on a
    Hopper GPU load through TMA descriptors (`tma=None`); `tma=True` forces that kernel where
    descriptors work (the interpreter too: the tests), False the pointer kernel.

    One kernel computes both projections of an output tile (one pass over x, each weight row read
    once per row block) and applies SiLU and the product in its epilogue (SwiGLU: Shazeer 2020,
    "GLU Variants Improve Transformer"), so the [S, 2 m] projection never goes to memory. The
    roundings are the eager step's (each projection rounded to the model dtype, bias first; SiLU in
    float32, rounded; the product rounded); the projections accumulate in float32 in another order
    than cuBLAS, so results equal `model.attention_output_mlp`'s to float rounding."""
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
