"""Plain sampling (greedy or temperature, no top-k/top-p) of a decode step in two Triton kernels.

Owns: `sample_plain_fused(logits, temperature, greedy, uniform)`, the contract of
`sampling.sample_plain` (tokens [R] long, logprobs [R] float32, no host sync) in two passes
that read the [R, vocab] logits about once (its docstring gives the algorithm);
`sample_packed`, the same two kernels in the CUDA-graph decode step's layout (its [3, R]
float64 sampling inputs in, [2, R] out, the tokens written as the next step's input ids, so
the sampling graph holds the two kernels and nothing else); and `sample_lm_head`, the first
pass moved into the LM head's matmul (the logits written once, read back only in the chosen
block), used up to `LM_HEAD_ROWS` rows where it is faster.

Does not own: when it runs (decode_graph.py, under `decode_compile` on CUDA) or the
definition of a generation logprob (sampling.py). Read more: docs/generation.md.
"""

from __future__ import annotations

import torch

from rl_core.generation.native.triton_support import (descriptor, gdc_launch_dependents, gdc_wait, interpreting, pdl_flags, tl,
                                                      tma_usable, triton)
from rl_core.generation.native.sampling import CDF_BLOCK

SPLITS = 8  # programs per row in the first pass
CHUNK_BLOCKS = 16  # CDF blocks per inner step of the first pass (faster than 8: bench/decode_kernels_gpu.py)
STATS_WARPS = 4  # warps per program of the first pass


def available(device: torch.device) -> bool:
    return triton is not None and (device.type == "cuda" or interpreting())


if triton is not None:

    @triton.jit
    def _block_stats_kernel(logits, stride_row, inputs, stride_inputs, block_max, block_sum, split_max, split_arg,
                            vocab, num_blocks, blocks_per_split,
                            BLOCK: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr):
        row = tl.program_id(0)
        split = tl.program_id(1)
        t, is_greedy = _temperature_greedy(inputs, stride_inputs, row)
        first = split * blocks_per_split
        last = tl.minimum(first + blocks_per_split, num_blocks)
        # x / 1 is x bit for bit, so a row at temperature 1 (RL's usual) skips the division: the same
        # statistics in less time for this kernel (bench/decode_kernels_gpu.py). The branch
        # is taken once per program, outside the loop.
        row_logits = logits + row * stride_row
        row_max, row_sum = block_max + row * num_blocks, block_sum + row * num_blocks
        if t == 1.0:  # DIVIDE is a compile-time flag: the two calls are the two specialisations
            best, best_arg = _block_stats_range(row_logits, t, is_greedy, row_max, row_sum, vocab, first, last,
                                                BLOCK, CHUNK, False)
        else:
            best, best_arg = _block_stats_range(row_logits, t, is_greedy, row_max, row_sum, vocab, first, last,
                                                BLOCK, CHUNK, True)
        one = tl.arange(0, 1)
        tl.store(split_max + row * SPLITS + split + one, best)
        tl.store(split_arg + row * SPLITS + split + one, best_arg)

    @triton.jit
    def _block_stats_range(row_logits, t, is_greedy, row_max, row_sum, vocab, first, last,
                           BLOCK: tl.constexpr, CHUNK: tl.constexpr, DIVIDE: tl.constexpr):
        """The first pass over CDF blocks first..last-1 of one row: each block's max of x / T and sum of
        exp(x / T - that max) stored, and (greedy rows) the range's arg-max of x returned with its max."""
        lanes = tl.arange(0, BLOCK)
        best = tl.full([1], float("-inf"), tl.float32)
        best_arg = tl.zeros([1], tl.int32)
        for start in range(first, last, CHUNK):
            b = start + tl.arange(0, CHUNK)
            in_range = b < last
            idx = b[:, None] * BLOCK + lanes[None, :]
            valid = in_range[:, None] & (idx < vocab)
            x = tl.load(row_logits + idx, mask=valid, other=float("-inf")).to(tl.float32)
            if DIVIDE:
                y = x / t
            else:
                y = x
            m = tl.max(y, axis=1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            s = tl.sum(tl.exp(y - m_safe[:, None]), axis=1)
            tl.store(row_max + b, m, mask=in_range)
            tl.store(row_sum + b, s, mask=in_range)
            if is_greedy:  # only greedy rows read the arg-max: sampled rows skip two of four reductions
                # Arg-max of the chunk without a reshape: the first block holding the chunk's maximum,
                # then the first index inside it.
                row_best = tl.max(x, axis=1)
                row_arg = tl.argmax(x, axis=1, tie_break_left=True)
                chunk_best = tl.max(row_best, axis=0)
                first_block = tl.argmax(row_best, axis=0, tie_break_left=True)
                lane = tl.arange(0, CHUNK)
                inside = tl.sum(tl.where(lane == first_block, row_arg, 0), axis=0)
                chunk_arg = (start + first_block) * BLOCK + inside
                take = chunk_best > best  # strictly: an earlier chunk keeps a tie
                best_arg = tl.where(take, chunk_arg, best_arg)
                best = tl.where(take, chunk_best, best)
        return best, best_arg

    # (The kernels' argument is `inputs`, not `params`: Triton's launcher binds the arguments into a
    # local of that name, and an argument so named reaches the launch as a dict.)
    @triton.jit
    def _temperature_greedy(inputs, stride_inputs, row):
        """A row's temperature (float64 -> float32, as `inputs[0].float()`) and greedy flag (> 0.5)."""
        return tl.load(inputs + row).to(tl.float32), tl.load(inputs + stride_inputs + row) > 0.5

    @triton.jit
    def _select_kernel(logits, stride_row, inputs, stride_inputs, block_max, block_sum, split_max, split_arg,
                       out, stride_out, ids, vocab, num_blocks, splits,
                       BLOCK: tl.constexpr, BLOCKS_PAD: tl.constexpr, SPLITS: tl.constexpr, HAS_IDS: tl.constexpr):
        """The second pass. `splits` arg-max entries per row (SPLITS: that count rounded up to a power of
        two): `SPLITS` of the first pass, or one per CDF block from `_lm_head_stats_kernel`."""
        row = tl.program_id(0)
        t, is_greedy = _temperature_greedy(inputs, stride_inputs, row)
        one = tl.full([], 1.0, tl.float64)
        u = tl.minimum(tl.load(inputs + 2 * stride_inputs + row), one - tl.full([], 2.0**-40, tl.float64))
        j = tl.arange(0, BLOCKS_PAD)
        has = j < num_blocks
        bmax = tl.load(block_max + row * num_blocks + j, mask=has, other=float("-inf"))
        bsum = tl.load(block_sum + row * num_blocks + j, mask=has, other=0.0)
        m = tl.max(bmax, axis=0)
        scaled = tl.where(bmax == float("-inf"), 0.0, bsum * tl.exp(bmax - m))
        log_sum = tl.log(tl.sum(scaled, axis=0))
        log_z = m + log_sum
        probs = tl.where(bmax == float("-inf"), 0.0, bsum * tl.exp(bmax - log_z)).to(tl.float64)
        cdf = tl.cumsum(probs, axis=0)
        target = u * tl.sum(probs, axis=0)  # u capped at 1 - 2^-40, as sampling.inverse_cdf does
        chosen = tl.minimum(tl.sum((cdf <= target).to(tl.int32), axis=0), num_blocks - 1)
        before = tl.sum(tl.where(j < chosen, probs, 0.0), axis=0)
        lanes = tl.arange(0, BLOCK)
        idx = chosen * BLOCK + lanes
        x = tl.load(logits + row * stride_row + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        p = tl.exp(x / t - log_z)
        inner = tl.cumsum(p.to(tl.float64), axis=0) + before
        i = tl.sum((inner <= target).to(tl.int32), axis=0)
        last = tl.max(tl.where(p > 0, lanes, -1), axis=0)
        sampled = chosen * BLOCK + tl.minimum(i, last)
        s = tl.arange(0, SPLITS)
        s_ok = s < splits
        smax = tl.load(split_max + row * splits + s, mask=s_ok, other=float("-inf"))
        sarg = tl.load(split_arg + row * splits + s, mask=s_ok, other=2147483647)
        top = tl.max(smax, axis=0)
        arg = tl.min(tl.where(smax == top, sarg, 2147483647), axis=0)  # first index among equal maxima
        token = tl.where(is_greedy, arg, sampled)
        x_token = tl.load(logits + row * stride_row + token).to(tl.float32)
        logprob = (x_token / t - m) - log_sum  # float32, as sample_plain's
        tl.store(out + row, token.to(tl.float64))
        tl.store(out + stride_out + row, logprob.to(tl.float64))
        if HAS_IDS:
            tl.store(ids + row, token.to(tl.int64))

    from rl_core.generation.native.fused_mlp import rounded

    @triton.jit
    def _lm_head_stats_kernel(x_desc, w_desc, logits, stride_row, inputs, stride_inputs, block_max, block_sum,
                              block_top, block_arg, rows, vocab, hidden, num_blocks,
                              IEEE: tl.constexpr, BF16_BITS: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                              WORK: tl.constexpr = 2):
        """The LM head with the first pass in its epilogue: one program per (row block, CDF block of
        BLOCK_N = `CDF_BLOCK` tokens) computes the tile's logits (x @ W^T, tiles loaded through TMA
        descriptors), rounds them to the model dtype (the projection's output), stores them, and writes
        the CDF block's maximum of x / T and sum of exp(x / T - that maximum) per row, and for row
        blocks holding a greedy row the block's arg-max (first index on ties): `_block_stats_kernel`'s
        numbers with one arg-max entry per CDF block, and the logits never read back whole. WORK 0: the
        logits alone, 1: and the maxima, 2: everything (bench/decode_kernels_gpu.py times the parts)."""
        if PDL:
            gdc_wait()
        off_m = tl.program_id(0) * BLOCK_M
        pid_n = tl.program_id(1)
        off_n = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):
            a = x_desc.load([off_m, k])
            w = w_desc.load([off_n, k])
            if IEEE:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32).T, input_precision="ieee")
            else:
                acc = tl.dot(a, w.T, acc)
        if PDL:
            gdc_launch_dependents()
        r = off_m + tl.arange(0, BLOCK_M)
        c = off_n + tl.arange(0, BLOCK_N)
        row_ok = r < rows
        col_ok = c < vocab
        dtype = logits.dtype.element_ty
        x = rounded(acc, dtype, BF16_BITS)
        tl.store(logits + r[:, None] * stride_row + c[None, :], x.to(dtype), mask=row_ok[:, None] & col_ok[None, :])
        if WORK == 0:
            return
        x = tl.where(col_ok[None, :], x, float("-inf"))
        t = tl.load(inputs + r, mask=row_ok, other=1.0).to(tl.float32)
        y = x / t[:, None]
        m = tl.max(y, axis=1)
        tl.store(block_max + r * num_blocks + pid_n, m, mask=row_ok)
        if WORK == 1:
            return
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        s = tl.sum(tl.exp(y - m_safe[:, None]), axis=1)
        tl.store(block_sum + r * num_blocks + pid_n, s, mask=row_ok)
        greedy = tl.load(inputs + stride_inputs + r, mask=row_ok, other=0.0) > 0.5
        if tl.max(greedy.to(tl.int32), axis=0) > 0:  # only greedy rows read the arg-max
            tl.store(block_top + r * num_blocks + pid_n, tl.max(x, axis=1), mask=row_ok)
            arg = off_n + tl.argmax(x, axis=1, tie_break_left=True)
            tl.store(block_arg + r * num_blocks + pid_n, arg.to(tl.int32), mask=row_ok)


def sample_plain_fused(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                       uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampling.sample_plain` in two kernels: logits [R, V] (any float dtype, unit stride
    in V), temperature [R] float32, greedy [R] bool, uniform [R] float64 -> (tokens [R]
    long, logprobs [R] float32).

    1. `_block_stats_kernel`, grid (rows, splits): per block of `sampling.CDF_BLOCK` tokens, the
       maximum of x / T and the sum of exp(x / T - that maximum), plus, for greedy rows only,
       each split's arg-max of the raw logits (first index on ties).
    2. `_select_kernel`, grid (rows,): log Z = m + log(sum_b sum_b' exp(max_b - m)) (the
       max-shifted log-sum-exp combined blockwise), the block probabilities' cumulative sum in
       float64, the block holding u * total, then the token inside it from its logits (the
       two-level inverse CDF of `sampling.inverse_cdf`, with its guards: u capped at 1 - 2^-40,
       never a zero-probability token), or the arg-max for greedy rows; and the logprob
       (x_token / T - m) - log(sum), i.e. `log_softmax(logits.float() / T)` at the token.
    The values equal `sample_plain`'s up to float32 rounding of the sums (a sampled token can
    differ only when its uniform lies within that rounding of a CDF boundary; greedy tokens are
    the same)."""
    inputs = torch.stack((temperature.double(), greedy.double(), uniform.double()))
    out = sample_packed(logits, inputs)
    return out[0].long(), out[1].float()


def sample_packed(logits: torch.Tensor, inputs: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """`sample_plain_fused` in the decode runner's layout, with nothing around the two kernels: inputs
    [3, R] float64 (temperature, greedy > 0.5, uniform per row, unit stride in R) -> [2, R] float64
    (token, logprob per row; the logprob computed in float32); with `ids` ([R] int64) the tokens are
    also written there (the next step's input ids, for `overlap_steps`)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if inputs.shape != (3, rows) or inputs.dtype != torch.float64 or inputs.stride(1) != 1:
        raise ValueError(f"sample_packed needs inputs [3, {rows}] float64 with unit stride in rows; got "
                         f"{tuple(inputs.shape)} {inputs.dtype} strides {inputs.stride()}")
    num_blocks = triton.cdiv(vocab, CDF_BLOCK)
    per_split = triton.cdiv(num_blocks, SPLITS)
    dev = logits.device
    block_max = torch.empty(rows, num_blocks, dtype=torch.float32, device=dev)
    block_sum = torch.empty(rows, num_blocks, dtype=torch.float32, device=dev)
    split_max = torch.empty(rows, SPLITS, dtype=torch.float32, device=dev)
    split_arg = torch.empty(rows, SPLITS, dtype=torch.int32, device=dev)
    out = torch.empty(2, rows, dtype=torch.float64, device=dev)
    if rows == 0:
        return out
    _block_stats_kernel[(rows, SPLITS)](logits, logits.stride(0), inputs, inputs.stride(0), block_max, block_sum,
                                        split_max, split_arg, vocab, num_blocks, per_split,
                                        BLOCK=CDF_BLOCK, CHUNK=CHUNK_BLOCKS, SPLITS=SPLITS, num_warps=STATS_WARPS)
    _select_kernel[(rows,)](logits, logits.stride(0), inputs, inputs.stride(0), block_max, block_sum, split_max,
                            split_arg, out, out.stride(0), ids if ids is not None else out, vocab, num_blocks, SPLITS,
                            BLOCK=CDF_BLOCK, BLOCKS_PAD=triton.next_power_of_2(num_blocks), SPLITS=SPLITS,
                            HAS_IDS=ids is not None, num_warps=8)
    return out


# The LM head + first pass kernel's tile (BLOCK_M, BLOCK_K, warps, stages) by row regime (64: up to 64 rows,
# else 256); BLOCK_N is the CDF block. The fastest of the tiles swept by bench/decode_kernels_gpu.py
# --parts lmhead. The interpreter runs small tiles with IEEE dots (float32 runs only there:
# `lm_head_usable`).
LM_HEAD_TILES = {64: (64, 64, 4, 3), 256: (256, 64, 8, 4)}
# The decode runner samples through `sample_lm_head` where `lm_head_usable` (a switch for benchmarks:
# bench/generation_gpu.py's `+unfusedhead` runs without it); read when a runner is built.
LM_HEAD = True
# ... for steps of up to this many rows: there the fused head beats cuBLAS + `sample_packed` (a slightly
# shorter decode step); from 128 rows on it is even or slower, because its epilogue's exponentials do
# not overlap the next tile's main loop (docs/generation.md, "What we learned").
LM_HEAD_ROWS = 64


def lm_head_usable(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `sample_lm_head` runs for these: Triton, a bf16/fp16 CUDA tensor (or the interpreter),
    tensors TMA can read (Hopper; `triton_support.tma_usable`), and a [vocab, hidden] weight."""
    return (triton is not None and weight.dim() == 2 and hidden.shape[-1] == weight.shape[1]
            and (interpreting() or hidden.dtype in (torch.bfloat16, torch.float16))
            and hidden.dtype == weight.dtype and tma_usable(hidden, weight))


def sample_lm_head(hidden: torch.Tensor, weight: torch.Tensor, inputs: torch.Tensor, ids: torch.Tensor | None = None,
                   tile: tuple[int, int, int, int] | None = None, work: int = 2) -> torch.Tensor:
    """`sample_packed(F.linear(hidden, weight), inputs, ids)` with the first pass in the LM head's
    epilogue (`_lm_head_stats_kernel`): the [R, vocab] logits are written once and read back only
    in the chosen CDF block of each row. hidden [R, H] (the final norm's output), weight [vocab, H]
    (no bias), any number of rows (the decode runner uses it up to `LM_HEAD_ROWS`); the same values
    up to float rounding (the logits' products summed in another order than cuBLAS's, the block sums
    in another order than the first pass's). `tile` (BLOCK_M, BLOCK_K,
    warps, stages) overrides `LM_HEAD_TILES` (benchmarks); `work` 0 or 1 runs the kernel with part of
    its epilogue and returns the logits (benchmarks: what the sampling work costs)."""
    rows = hidden.shape[0]
    vocab = weight.shape[0]
    if not lm_head_usable(hidden, weight):
        raise ValueError(f"sample_lm_head needs a [R, H] input and a [vocab, H] weight of one dtype (bf16/fp16 on a "
                         f"Hopper GPU) that TMA can read; got {tuple(hidden.shape)} {hidden.dtype} and "
                         f"{tuple(weight.shape)} {weight.dtype}. Use sample_packed on the logits instead.")
    if inputs.shape != (3, rows) or inputs.dtype != torch.float64 or inputs.stride(1) != 1:
        raise ValueError(f"sample_lm_head needs inputs [3, {rows}] float64 with unit stride in rows; got "
                         f"{tuple(inputs.shape)} {inputs.dtype} strides {inputs.stride()}")
    if interpreting():
        bm, bk, warps, stages = 16, 32, 4, 2
    else:
        bm, bk, warps, stages = tile or LM_HEAD_TILES[64 if rows <= 64 else 256]
    num_blocks = triton.cdiv(vocab, CDF_BLOCK)
    dev = hidden.device
    logits = hidden.new_empty(rows, vocab)
    block_max, block_sum, block_top = (torch.empty(rows, num_blocks, dtype=torch.float32, device=dev) for _ in range(3))
    block_arg = torch.empty(rows, num_blocks, dtype=torch.int32, device=dev)
    out = torch.empty(2, rows, dtype=torch.float64, device=dev)
    if rows == 0:
        return out
    _lm_head_stats_kernel[(triton.cdiv(rows, bm), num_blocks)](
        descriptor(hidden, [bm, bk]), descriptor(weight, [CDF_BLOCK, bk]), logits, logits.stride(0), inputs,
        inputs.stride(0), block_max, block_sum, block_top, block_arg, rows, vocab, weight.shape[1], num_blocks,
        IEEE=interpreting(), BF16_BITS=interpreting() and hidden.dtype == torch.bfloat16, BLOCK_M=bm, BLOCK_N=CDF_BLOCK,
        BLOCK_K=bk, STAGES=stages, WORK=work, **pdl_flags(hidden), **({} if interpreting() else dict(num_warps=warps)))
    if work < 2:
        return logits
    pad = triton.next_power_of_2(num_blocks)
    _select_kernel[(rows,)](logits, logits.stride(0), inputs, inputs.stride(0), block_max, block_sum, block_top,
                            block_arg, out, out.stride(0), ids if ids is not None else out, vocab, num_blocks, num_blocks,
                            BLOCK=CDF_BLOCK, BLOCKS_PAD=pad, SPLITS=pad, HAS_IDS=ids is not None, num_warps=8)
    return out
