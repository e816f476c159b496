"""Split-K projections for the static/graph decode step: float32 partial sums, summed by the add + norm after them.

Owns: `partials(a, weight)`, a Triton matmul of a [S, K] input by an nn.Linear weight [N, K]
whose K range is cut into slices, one program per (row block, column block, slice), each
writing its slice's float32 sum to a [splits, S, N] result (its docstring says why);
`add_norm(x, parts, bias, ln, eps)`, one Triton kernel that sums the slices, adds the bias,
rounds to the model dtype (a cuBLAS projection with its bias in the epilogue, up to summation
order), adds the residual, rounds and RMS-norms the rows (model.rms_norm's roundings);
`linear` (one slice, the QKV projection); `summed` (the torch reference of the tests); and the
tiles (`TILES`: fixed per row regime and projection, swept L2-cold; float32 and Triton's CPU
interpreter use small tiles and IEEE dots, the exact path of the tests).

Does not own: which projections use it (fused_stack.py), when the fused step runs
(decode_graph.py), Triton's import (triton_support.py), `rounded` and `program_tile` (fused_mlp.py).
"""

from __future__ import annotations

import torch

from rl_core.generation.native import triton_support
from rl_core.generation.native.triton_support import (descriptor, gdc_launch_dependents, gdc_wait, interpreting, pdl_flags, tl,
                                                      tma_usable, triton)

# (BLOCK_M, BLOCK_N, BLOCK_K, splits, warps, stages, TMA) for bf16/fp16 on CUDA, by (64: up to 64 rows,
# else 256; kind): the fastest of a sweep at 64 and 256 rows of the Qwen2.5-0.5B shapes with the
# weights L2-cold (bench/split_k_cold_sweep.py: copies of each weight cycled, so that every call reads
# its weight from HBM, as a decode step's layers do). A sweep with one weight, L2-warm
# (bench/decode_kernels_gpu.py --parts splitk / tma), picks tiles that are fast there and slow in the
# engine. Deeper pipelines (4-5 stages) and 128-256 deep K blocks keep more of the weight in flight
# (docs/generation.md, "What we learned"; the step times: docs/benchmarks.md). Where TMA is not usable (before Hopper) a tile
# runs with pointer loads at `POINTER_STAGES` and K blocks of at most `POINTER_BLOCK_K`
# (`launch_tile`): the deep TMA pipelines would need up to 192 KB of shared memory.
DEFAULT_TILE = (64, 64, 128, 4, 4, 3, False)
TILES: dict[tuple[int, str], tuple[int, int, int, int, int, int, bool]] = {
    (256, "down"): (64, 64, 128, 2, 4, 5, True), (256, "output"): (64, 64, 128, 2, 4, 5, True),
    (64, "down"): (64, 32, 256, 4, 4, 4, True), (64, "output"): (64, 32, 256, 2, 4, 3, True),
    (256, "qkv"): (64, 64, 128, 1, 4, 5, True), (64, "qkv"): (64, 32, 256, 1, 4, 4, True)}
POINTER_STAGES, POINTER_BLOCK_K = 3, 128


def launch_tile(tile: tuple[int, int, int, int, int, int, bool], tma_ok: bool) -> tuple[int, int, int, int, int, int, bool]:
    """A `TILES` tile as it launches: as given where TMA is usable or the tile asks for pointer loads;
    a TMA tile on a device without TMA with pointer loads, at most `POINTER_STAGES` stages and
    `POINTER_BLOCK_K`-deep K blocks (at most 96 KB of shared memory for the tiles above)."""
    bm, bn, bk, splits, warps, stages, tma = tile
    if not tma or tma_ok:
        return tile
    return bm, bn, min(bk, POINTER_BLOCK_K), splits, warps, min(stages, POINTER_STAGES), False


_FIXED = (16, 32, 32)  # float32 and the interpreter: (BLOCK_M, BLOCK_N, BLOCK_K)

if triton is not None:
    from rl_core.generation.native.fused_mlp import program_tile, rounded

    @triton.jit
    def _partials_kernel(a, w, bias, out, rows, n, k_total, k_split, stride_a, stride_w,
                         IEEE: tl.constexpr, PDL: tl.constexpr, ROUNDED: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BF16_BITS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        if PDL:  # launched while the kernel before finishes: wait for it before any load or store
            gdc_wait()
        r, c, kk, row_ok, col_ok = program_tile(rows, n, BLOCK_M, BLOCK_N, BLOCK_K)
        pid_s = tl.program_id(2)
        k_lo = pid_s * k_split
        k_hi = tl.minimum(k_lo + k_split, k_total)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + kk
            k_ok = k < k_hi
            x = tl.load(a + r[:, None] * stride_a + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w + c[None, :] * stride_w + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(x.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(x, wt, acc)
        if PDL:
            gdc_launch_dependents()
        _store(out, bias, acc, r, c, rows, n, pid_s, ROUNDED, HAS_BIAS, BF16_BITS)

    @triton.jit
    def _store(out, bias, acc, r, c, rows, n, pid_s, ROUNDED: tl.constexpr, HAS_BIAS: tl.constexpr,
               BF16_BITS: tl.constexpr):
        """A slice's float32 sum to out[pid_s]; or (ROUNDED, one slice: `linear`) the sum + bias rounded
        to out's dtype, as a cuBLAS projection with its bias in the epilogue."""
        mask = (r < rows)[:, None] & (c < n)[None, :]
        if ROUNDED:
            if HAS_BIAS:
                acc += tl.load(bias + c, mask=c < n, other=0.0).to(tl.float32)[None, :]
            dtype = out.dtype.element_ty
            tl.store(out + r[:, None] * n + c[None, :], rounded(acc, dtype, BF16_BITS).to(dtype), mask=mask)
        else:
            tl.store(out + (pid_s * rows + r[:, None]) * n + c[None, :], acc, mask=mask)


    @triton.jit
    def _partials_tma_kernel(a_desc, w_desc, bias, out, rows, n, k_total, k_split, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
                             ROUNDED: tl.constexpr, HAS_BIAS: tl.constexpr, BF16_BITS: tl.constexpr,
                             ROWS_FIRST: tl.constexpr):
        """`_partials_kernel` with its tiles loaded through TMA descriptors (reads past the rows or
        past K give zeros, so only the store is masked); ROWS_FIRST: programs numbered row block
        first (`triton_support.ROWS_FIRST`)."""
        if PDL:
            gdc_wait()
        off_n = tl.program_id(1 if ROWS_FIRST else 0) * BLOCK_N
        off_m = tl.program_id(0 if ROWS_FIRST else 1) * BLOCK_M
        pid_s = tl.program_id(2)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in tl.range(pid_s * k_split, tl.minimum((pid_s + 1) * k_split, k_total), BLOCK_K, num_stages=STAGES):
            acc = tl.dot(a_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc)
        if PDL:
            gdc_launch_dependents()
        _store(out, bias, acc, off_m + tl.arange(0, BLOCK_M), off_n + tl.arange(0, BLOCK_N), rows, n, pid_s, ROUNDED,
               HAS_BIAS, BF16_BITS)

    @triton.jit
    def _add_norm_kernel(parts, splits, bias, x, ln, x_out, normed_out, rows, n, eps,
                         HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, BF16_BITS: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_wait()
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.arange(0, BLOCK_N)
        mask = (r < rows)[:, None] & (c < n)[None, :]
        offs = r[:, None] * n + c[None, :]
        dtype = x_out.dtype.element_ty
        acc = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
        for s in range(0, splits):
            acc += tl.load(parts + s * rows * n + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias + c, mask=c < n, other=0.0).to(tl.float32)[None, :]
        total = rounded(tl.load(x + offs, mask=mask, other=0.0).to(tl.float32) + rounded(acc, dtype, BF16_BITS),
                         dtype, BF16_BITS)
        if PDL:
            gdc_launch_dependents()
        tl.store(x_out + offs, total.to(dtype), mask=mask)
        if HAS_NORM:  # model.rms_norm: F.rms_norm in float32, rounded, then weight * it, rounded
            inv = 1.0 / tl.sqrt(tl.sum(total * total, axis=1) / n + eps)
            y = rounded(total * inv[:, None], dtype, BF16_BITS)
            w = tl.load(ln + c, mask=c < n, other=0.0).to(tl.float32)
            tl.store(normed_out + offs, rounded(w[None, :] * y, dtype, BF16_BITS).to(dtype), mask=mask)


# The add + norm kernel's launch: (rows a program, warps).
ADD_NORM_TILE = (1, 4)


def add_norm(x: torch.Tensor, parts: torch.Tensor, bias: torch.Tensor | None, ln: torch.Tensor | None, eps: float,
             tile: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fused_stack.partials_add_norm` as one Triton kernel: x + the projection given by its float32
    partials [splits, S, N] (summed, bias added, rounded), and that normed by `ln` (None: no norm).
    Returns (x after the add, the normed rows or None), both in x's dtype."""
    rows, n = x.shape
    x = x.contiguous()
    x_out = torch.empty_like(x)
    normed = torch.empty_like(x) if ln is not None else None
    if rows == 0:
        return x_out, normed
    block_r, warps = tile or ADD_NORM_TILE
    kwargs = {} if interpreting() else dict(num_warps=warps)
    _add_norm_kernel[(triton.cdiv(rows, block_r),)](
        parts, parts.shape[0], bias if bias is not None else x, x, ln if ln is not None else x, x_out,
        normed if normed is not None else x_out, rows, n, eps, HAS_BIAS=bias is not None, HAS_NORM=ln is not None,
        BF16_BITS=interpreting() and x.dtype == torch.bfloat16, BLOCK_R=block_r,
        BLOCK_N=triton.next_power_of_2(n), **pdl_flags(x), **kwargs)
    return x_out, normed


def partials(a: torch.Tensor, weight: torch.Tensor, splits: int | None = None, *, kind: str = "",
             tile: tuple[int, int, int, int, int, int, bool] | None = None) -> torch.Tensor:
    """a [S, K], weight [N, K] contiguous in K: returns float32 [splits, S, N] whose sum over dim 0
    is a @ weight^T. `kind` ("output", "down") picks the CUDA tile from `TILES` (`tile` overrides
    it, for benchmarks and the tests: its TMA flag is honoured where `tma_usable`, also in the
    interpreter); `splits` overrides the tile's.

    Why: at decode batch sizes (64-256 rows) the output and down projections have few output
    tiles, so cuBLAS splits K itself and runs a second kernel to reduce its slices, then the
    compiled residual add + norm reads the result again. Here the slices go to memory as float32
    (small beside the weights) and `add_norm` sums them: one kernel and one round trip fewer per
    projection, with a tile that fits the shape. Computing the SiLU gate in the down projection's
    loads, and summing the slices in Inductor's compiled add + norm, were slower and dropped."""
    return _matmul(a, weight, None, splits, kind, tile, to_dtype=False)


def linear(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, kind: str = "qkv",
           tile: tuple[int, int, int, int, int, int, bool] | None = None) -> torch.Tensor:
    """F.linear(a, weight, bias) [S, N] in a's dtype by the same kernels in one slice (the sum and the
    bias rounded once, as cuBLAS's epilogue): the QKV projection of the stack, a Triton kernel so that
    it too launches under PDL (`triton_support.pdl`)."""
    return _matmul(a, weight, bias, 1, kind, tile, to_dtype=True)


def _matmul(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, splits: int | None, kind: str,
            tile: tuple[int, int, int, int, int, int, bool] | None, to_dtype: bool) -> torch.Tensor:
    rows = a.shape[0]
    n, k_total = weight.shape
    if weight.stride(-1) != 1 or a.shape[1] != k_total:
        raise ValueError(f"split_k.{'linear' if to_dtype else 'partials'} needs a [N, K] weight contiguous in K and a [S, K] input; got weight "
                         f"{tuple(weight.shape)} (strides {weight.stride()}), input {tuple(a.shape)}")
    a = a.contiguous()
    ieee = a.dtype == torch.float32 or interpreting()
    tma_ok = tma_usable(a, weight)
    if tile is None and (ieee or a.device.type != "cuda"):
        bm, bn, bk, split_n, warps, stages, tma = *_FIXED, splits or 2, 4, 2, False
    else:
        bm, bn, bk, split_n, warps, stages, tma = tile or launch_tile(
            TILES.get((64 if rows <= 64 else 256, kind), DEFAULT_TILE), tma_ok)
        split_n = splits or split_n
    tma = tma and tma_ok
    k_split = triton.cdiv(triton.cdiv(k_total, split_n), bk) * bk  # each slice a whole number of blocks
    split_n = triton.cdiv(k_total, k_split)
    if to_dtype and split_n != 1:
        raise ValueError(f"split_k.linear runs one slice; its tile has {split_n}")
    out = (a.new_empty(rows, n) if to_dtype else torch.empty(split_n, rows, n, device=a.device, dtype=torch.float32))
    if rows == 0:
        return out
    grid = (triton.cdiv(n, bn), triton.cdiv(rows, bm), split_n)
    flags = dict(ROUNDED=to_dtype, HAS_BIAS=bias is not None, BF16_BITS=interpreting() and a.dtype == torch.bfloat16,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **pdl_flags(a))
    b = bias if bias is not None else out
    if tma:
        rows_first = triton_support.ROWS_FIRST
        _partials_tma_kernel[(grid[1], grid[0], grid[2]) if rows_first else grid](
            descriptor(a, [bm, bk]), descriptor(weight, [bn, bk]), b, out, rows, n, k_total, k_split,
            STAGES=stages, ROWS_FIRST=rows_first, **flags, **({} if interpreting() else dict(num_warps=warps)))
        return out
    kwargs = {} if interpreting() else dict(num_warps=warps, num_stages=stages)
    _partials_kernel[grid](a, weight, b, out, rows, n, k_total, k_split, a.stride(0), weight.stride(0), IEEE=ieee,
                           **flags, **kwargs)
    return out


def summed(parts: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The projection from its partial sums: summed in float32, the bias added, rounded to `dtype`
    (torch code: compiled into the consumer's element-wise kernel)."""
    total = parts.sum(0)
    if bias is not None:
        total = total + bias.float()
    return total.to(dtype)
