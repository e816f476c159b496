"""The decode step's kernels one at a time on a GPU: the fused kernels against what they replace.

Run on a CUDA machine (one GPU):

    .venv/bin/python bench/decode_kernels_gpu.py [--rows 64 256]

Qwen2.5-0.5B shapes (hidden 896, MLP 4864, vocab 151,936), bf16, random data. Each entry is
the device time of one call, measured as 20 replays of a CUDA graph holding 10 calls (so
launch overhead is not counted, as in the engine's graph replay), median of 5, in
microseconds, with the bytes the call must move at least and the bandwidth that implies.
Printed side by side in one run; never a test assertion.

- MLP first half: cuBLAS gate/up projection alone, + the SiLU gate (eager and compiled),
  against `fused_mlp.gate_up_silu` (the autotuned tile printed).
- `--sweep`: `gate_up_silu` at a grid of explicit tiles (the fastest printed), and each decode
  projection (QKV, output, gate/up, down, LM head) by cuBLAS against the kernel Inductor's
  `max-autotune-no-cudagraphs` picks for that one shape.
- Decode attention: `decode_attention.rope_store_attend` at the Qwen2.5-0.5B head shape,
  positions spread around 192, at each tile of `decode_attention.TILES`.
- `--parts splitk`: the stack's output and down projections as split-K float32 partials summed
  in one add + norm kernel (split_k.py), against cuBLAS (with its own split-K reduce) + the
  compiled add + norm; each part alone (the add + norm at several launch shapes) and, with
  `--sweep`, the partials at a grid of tiles.
- `--parts tma`: the gate/up + SiLU kernel and the split-K down projection with their tiles
  loaded through TMA descriptors (Hopper), at a grid of tiles, against the pointer loads and cuBLAS.
- `--parts attention-probe`: the attention kernel at equal positions (as in a generation step)
  against a kernel that only reads the same keys and values, and a torch sum of them.
- `--parts attention-fp8` / `attention-probe-fp8`: the same two on an FP8 (e4m3) cache with per-head
  scales (`kv_cache_dtype: fp8_e4m3`: 1 byte a key/value element, the bytes column counts those);
  `--parts attention attention-fp8` prints the bf16 and FP8 caches side by side.
- `--parts lmhead`: the LM head and the in-step sampling, cuBLAS + `fused_sampling.sample_packed`
  against `fused_sampling.sample_lm_head` (the sampling's first pass in the head's epilogue) at a
  grid of tiles, at temperature 1 and 0.7, and with every row greedy.
- In-step sampling: `fused_sampling.sample_plain_fused` over [rows, vocab] bf16 logits at
  several first-pass shapes (programs per row, CDF blocks per inner step, warps), at temperature
  1 (the first pass skips its division), every row greedy (the arg-max reductions run too), and
  the compiled `sampling.sample_plain` for reference.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

HIDDEN, MLP, VOCAB = 896, 4864, 151936


def device_us(fn, calls: int = 10, replays: int = 20, repeats: int = 5) -> float:
    """Median device time of one call of `fn`, in microseconds (CUDA graph of `calls` calls)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * calls))
    return statistics.median(times)


def report(name: str, us: float, nbytes: int) -> None:
    print(f"  {name:<58} {us:8.2f} us   {nbytes / 1e6:7.1f} MB   {nbytes / us / 1e6:5.2f} TB/s", flush=True)


def mlp(rows: int) -> None:
    from rl_core.generation.native import fused_mlp

    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * MLP, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN ** 0.5
    nbytes = w.numel() * 2 + x.numel() * 2 + rows * MLP * 2

    def gated(y):
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up

    compiled = torch.compile(gated, dynamic=False)
    y = F.linear(x, w)
    compiled(y)
    print(f"MLP first half, rows {rows}: [{rows}, {HIDDEN}] x [{2 * MLP}, {HIDDEN}]^T, then silu(gate) * up")
    report("cuBLAS gate/up projection alone", device_us(lambda: F.linear(x, w)), w.numel() * 2 + 2 * y.numel() * 2)
    report("compiled SiLU gate alone", device_us(lambda: compiled(y)), y.numel() * 2 + rows * MLP * 2)
    report("cuBLAS projection + eager SiLU gate", device_us(lambda: gated(F.linear(x, w))), nbytes)
    report("cuBLAS projection + compiled SiLU gate", device_us(lambda: compiled(F.linear(x, w))), nbytes)
    report("fused_mlp.gate_up_silu (one Triton kernel)", device_us(lambda: fused_mlp.gate_up_silu(x, w, None)), nbytes)
    print(f"    autotuned tile: {fused_mlp.tuned_config()}")


def sweep_gate_up(rows: int, top: int = 10) -> None:
    """`gate_up_silu` at explicit tiles (not only the autotuner's six): which tile shape suits `rows`."""
    import itertools

    import triton

    from rl_core.generation.native import fused_mlp

    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * MLP, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN ** 0.5
    nbytes = w.numel() * 2 + x.numel() * 2 + rows * MLP * 2
    ref = fused_mlp.gate_up_silu(x, w, None)
    out = torch.empty_like(ref)
    flags = dict(HAS_BIAS=False, IEEE=False, BF16_BITS=False)
    row_class = min(max(16, 1 << (rows - 1).bit_length()), 256)
    results = []
    for bm, bn, bk, warps, stages in itertools.product((16, 32, 64, 128, 256), (16, 32, 64, 128), (64, 128),
                                                       (4, 8), (3, 4)):
        if bm > max(16, rows) or bm < rows // 8 or bm * bn > 256 * 64 or (bm * bk + 2 * bk * bn) * 2 * stages > 200_000:
            continue
        grid = (triton.cdiv(MLP, bn), triton.cdiv(rows, bm))

        def call():
            fused_mlp._gate_up_silu_kernel[grid](x, w, x, out, rows, row_class, MLP, HIDDEN, x.stride(0), w.stride(0),
                                                  out.stride(0), **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                                  num_warps=warps, num_stages=stages)
        try:
            call()
            diff = float((out.float() - ref.float()).abs().max())
            results.append((device_us(call), (bm, bn, bk, warps, stages), diff))
        except Exception as exc:  # out of shared memory or registers: not a candidate
            print(f"    tile {(bm, bn, bk, warps, stages)}: {type(exc).__name__}")
    results.sort()
    print(f"gate_up_silu tile sweep, rows {rows}: {len(results)} tiles ran; the fastest {top} "
          "(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages; max |diff| to the autotuned output)")
    for us, cfg, diff in results[:top]:
        report(f"tile {cfg}, diff {diff:.3g}", us, nbytes)


def projections(rows: int) -> None:
    """The decode layer's other projections at `rows`: cuBLAS against Inductor's max-autotune choice."""
    print(f"projections, rows {rows} (cuBLAS vs torch.compile max-autotune-no-cudagraphs, one shape each)")
    for name, n, k in (("QKV", 1152, HIDDEN), ("output", HIDDEN, HIDDEN), ("gate/up", 2 * MLP, HIDDEN),
                       ("down", HIDDEN, MLP), ("LM head", VOCAB, HIDDEN)):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        nbytes = (w.numel() + x.numel() + rows * n) * 2
        report(f"{name} [{rows}, {k}] x [{n}, {k}]^T, cuBLAS", device_us(lambda: F.linear(x, w)), nbytes)
        torch._dynamo.reset()
        tuned = torch.compile(lambda a: F.linear(a, w), mode="max-autotune-no-cudagraphs", dynamic=False)
        try:
            tuned(x)
            report(f"{name}, max-autotune", device_us(lambda: tuned(x)), nbytes)
        except Exception as exc:
            print(f"    {name}, max-autotune failed: {type(exc).__name__}: {exc}"[:300])


def sampling(rows: int) -> None:
    from rl_core.generation.native import fused_sampling
    from rl_core.generation.native.sampling import sample_plain

    logits = torch.randn(rows, VOCAB, device="cuda", dtype=torch.bfloat16) * 3
    t = torch.full((rows,), 0.9, device="cuda")
    greedy = torch.zeros(rows, dtype=torch.bool, device="cuda")
    u = torch.rand(rows, device="cuda", dtype=torch.float64)
    nbytes = logits.numel() * 2
    print(f"In-step sampling, rows {rows}, vocab {VOCAB} (bf16 logits read at least once)")
    compiled = torch.compile(sample_plain, dynamic=False)
    report("compiled sample_plain", device_us(lambda: compiled(logits, t, greedy, u)), nbytes)
    default = (fused_sampling.SPLITS, fused_sampling.CHUNK_BLOCKS, fused_sampling.STATS_WARPS)
    ref = fused_sampling.sample_plain_fused(logits, t, greedy, u)
    for splits, chunk, warps in [default, (8, 8, 4), (8, 32, 8), (16, 16, 4), (32, 16, 4), (32, 8, 4)]:
        fused_sampling.SPLITS, fused_sampling.CHUNK_BLOCKS, fused_sampling.STATS_WARPS = splits, chunk, warps
        got = fused_sampling.sample_plain_fused(logits, t, greedy, u)
        same = bool((got[0] == ref[0]).all()) and float((got[1] - ref[1]).abs().max()) < 1e-4
        us = device_us(lambda: fused_sampling.sample_plain_fused(logits, t, greedy, u))
        report(f"fused, {splits} programs/row, {chunk} blocks/step, {warps} warps{'' if same else ' (DIFFERS)'}",
               us, nbytes)
    fused_sampling.SPLITS, fused_sampling.CHUNK_BLOCKS, fused_sampling.STATS_WARPS = default
    unit = torch.ones(rows, device="cuda")  # temperature 1: the first pass skips its division
    report("fused, default, temperature 1", device_us(lambda: fused_sampling.sample_plain_fused(logits, unit, greedy, u)),
           nbytes)
    every = torch.ones(rows, dtype=torch.bool, device="cuda")  # the arg-max reductions too
    report("fused, default, every row greedy", device_us(lambda: fused_sampling.sample_plain_fused(logits, t, every, u)),
           nbytes)


def lm_head(rows: int) -> None:
    """The LM head and the in-step sampling: cuBLAS + `sample_packed` (the logits written, then read by
    the first pass) against `sample_lm_head` (the first pass in the head's epilogue) at a grid of tiles;
    the tokens and logprobs of each against the two-pass result on the same logits."""
    from rl_core.generation.native import fused_sampling as fs

    torch.manual_seed(0)
    h = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.1  # logits of std ~3
    nbytes = w.numel() * 2 + h.numel() * 2
    print(f"LM head + in-step sampling, rows {rows}, vocab {VOCAB} (bytes: the weight read once)")
    top: list = []  # the best tiles at temperature 1, run again at 0.7
    for temp in (1.0, 0.7):
        inputs = torch.zeros(3, rows, dtype=torch.float64, device="cuda")
        inputs[0] = temp
        inputs[2] = torch.rand(rows, dtype=torch.float64, device="cuda")
        logits = F.linear(h, w)
        report(f"T={temp}: cuBLAS LM head alone", device_us(lambda: F.linear(h, w)), nbytes)
        report(f"T={temp}: sample_packed alone (two passes over the logits)",
               device_us(lambda: fs.sample_packed(logits, inputs)), logits.numel() * 2)
        report(f"T={temp}: cuBLAS LM head + sample_packed", device_us(lambda: fs.sample_packed(F.linear(h, w), inputs)),
               nbytes)
        want = fs.sample_packed(logits, inputs)
        found = []
        grid = [(bm, bk, warps, stages) for bm in (64, 128, 256) for bk in (64, 128) for warps in (4, 8)
                for stages in (2, 3, 4) if bm <= max(64, rows) and not (bm == 256 and warps == 4)]
        for tile in grid if temp == 1.0 else top:  # the second temperature at the first one's best tiles
            try:
                got = fs.sample_lm_head(h, w, inputs, tile=tile)
                us = device_us(lambda: fs.sample_lm_head(h, w, inputs, tile=tile))
            except Exception as exc:  # a tile that does not fit (shared memory, registers)
                print(f"    tile {tile}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            same = float((got[0] == want[0]).double().mean())
            found.append((us, tile, same, float((got[1] - want[1]).abs().max())))
        found.sort()
        top = [f[1] for f in found[:3]]
        for us, tile, same, gap in found[:6]:
            report(f"T={temp}: sample_lm_head {tile}: same tokens {same:.4f}, logprob gap {gap:.2e}", us, nbytes)
        if temp == 1.0 and found:
            tile = found[0][1]
            for name, work in (("the logits alone (no sampling work in the epilogue)", 0),
                               ("the logits and the blocks' maxima", 1)):
                report(f"{name} {tile}", device_us(lambda: fs.sample_lm_head(h, w, inputs, tile=tile, work=work)), nbytes)
            every = inputs.clone()
            every[1] = 1.0
            report(f"every row greedy: sample_lm_head {tile}", device_us(lambda: fs.sample_lm_head(h, w, every, tile=tile)),
                   nbytes)
            report("every row greedy: cuBLAS LM head + sample_packed",
                   device_us(lambda: fs.sample_packed(F.linear(h, w), every)), nbytes)
            g1, g0 = fs.sample_lm_head(h, w, every, tile=tile), fs.sample_packed(logits, every)
            print(f"    greedy tokens equal: {float((g1[0] == g0[0]).double().mean()):.4f}")


try:  # the probe kernels below (CUDA builds of torch carry triton)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _kv_read_probe(positions, k_cache, v_cache, out, stride_slot, stride_head, stride_pos,
                       DIM: tl.constexpr, BLOCK_N: tl.constexpr):
        """Reads what the attention kernel reads (keys and values 0..pos-1 of one slot and KV head, in
        BLOCK_N-key tiles) and only sums them: the memory pipeline's floor for that access pattern."""
        slot = tl.program_id(0)
        kv_head = tl.program_id(1)
        pos = tl.load(positions + slot)
        d = tl.arange(0, DIM)
        base = slot * stride_slot + kv_head * stride_head
        acc = tl.zeros([BLOCK_N, DIM], tl.float32)
        for start in range(0, pos, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            offs = base + n[:, None] * stride_pos + d[None, :]
            valid = (n < pos)[:, None]
            acc += tl.load(k_cache + offs, mask=valid, other=0.0).to(tl.float32)
            acc += tl.load(v_cache + offs, mask=valid, other=0.0).to(tl.float32)
        tl.store(out + slot * 2 + kv_head, tl.sum(tl.sum(acc, axis=1), axis=0))



def tma(rows: int) -> None:
    """The TMA-loaded (Hopper) forms of the gate/up + SiLU kernel and the split-K partials at a grid of
    tiles, against the pointer-loaded kernels and cuBLAS."""
    import itertools

    from rl_core.generation.native import fused_mlp, split_k
    from rl_core.generation.native.triton_support import descriptor

    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * MLP, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN ** 0.5
    nbytes = w.numel() * 2 + x.numel() * 2 + rows * MLP * 2
    ref = fused_mlp.gate_up_silu(x, w, None)
    print(f"TMA kernels, rows {rows}")
    report("cuBLAS gate/up projection alone", device_us(lambda: F.linear(x, w)), nbytes)
    report("fused_mlp.gate_up_silu, pointer loads (autotuned)",
           device_us(lambda: fused_mlp.gate_up_silu(x, w, None, tma=False)), nbytes)
    report("fused_mlp.gate_up_silu, TMA at its tile", device_us(lambda: fused_mlp.gate_up_silu(x, w, None)), nbytes)
    out = torch.empty_like(ref)
    results = []
    for bm, bn, bk, warps, stages in itertools.product((64, 128), (32, 64, 128, 256), (64, 128), (4, 8), (2, 3, 4)):
        if (bm * bk + 2 * bn * bk) * 2 * stages > 220_000 or bm * bn * 2 > 128 * 256 or bm > max(64, rows):
            continue
        xd, gd, ud = descriptor(x, [bm, bk]), descriptor(w[:MLP], [bn, bk]), descriptor(w[MLP:], [bn, bk])
        grid = (triton.cdiv(MLP, bn), triton.cdiv(rows, bm))

        def call():
            fused_mlp._gate_up_silu_tma_kernel[grid](xd, gd, ud, x, out, rows, MLP, HIDDEN, out.stride(0),
                                                     HAS_BIAS=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                                     STAGES=stages, PDL=False, num_warps=warps)
        try:
            call()
            diff = float((out.float() - ref.float()).abs().max())
            results.append((device_us(call), (bm, bn, bk, warps, stages), diff))
        except Exception as exc:
            print(f"    tile {(bm, bn, bk, warps, stages)}: {type(exc).__name__}: {str(exc)[:120]}")
    results.sort()
    print(f"  gate/up + SiLU with TMA: {len(results)} tiles ran; the fastest 6 (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)")
    for us, cfg, diff in results[:6]:
        report(f"  tile {cfg}, diff {diff:.3g}", us, nbytes)
    # The QKV projection in one slice, rounded with its bias (split_k.linear).
    qw = torch.randn(1152, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN ** 0.5
    qb = torch.randn(1152, device="cuda", dtype=torch.bfloat16)
    report("QKV: cuBLAS with bias", device_us(lambda: F.linear(x, qw, qb)), qw.numel() * 2)
    report("QKV: split_k.linear at its tile", device_us(lambda: split_k.linear(x, qw, qb)), qw.numel() * 2)
    qref = F.linear(x, qw, qb).float()
    results = []
    for bm, bn, bk, stages, tma_on in itertools.product((64, 128), (32, 64, 128), (64, 128), (3, 4), (True, False)):
        tile = (bm, bn, bk, 1, 8 if bm == 128 else 4, stages, tma_on)
        if (bm * bk + bn * bk) * 2 * stages > 220_000 or bm > max(64, rows):
            continue
        try:
            diff = float((split_k.linear(x, qw, qb, tile=tile).float() - qref).abs().max())
            results.append((device_us(lambda: split_k.linear(x, qw, qb, tile=tile)), tile, diff))
        except Exception as exc:
            print(f"    tile {tile}: {type(exc).__name__}: {str(exc)[:120]}")
    results.sort()
    print(f"  QKV split_k.linear: {len(results)} tiles ran; the fastest 6 (BLOCK_M, BLOCK_N, BLOCK_K, splits, warps, "
          "stages, TMA)")
    for us, cfg, diff in results[:6]:
        report(f"  tile {cfg}, diff {diff:.3g}", us, qw.numel() * 2)
    # The split-K down projection.
    a = torch.randn(rows, MLP, device="cuda", dtype=torch.bfloat16)
    dw = torch.randn(HIDDEN, MLP, device="cuda", dtype=torch.bfloat16) / MLP ** 0.5
    report("down: cuBLAS alone", device_us(lambda: F.linear(a, dw)), dw.numel() * 2)
    report("down: split_k.partials at its tile", device_us(lambda: split_k.partials(a, dw, kind="down")),
           dw.numel() * 2)
    ref = F.linear(a, dw).float()
    results = []
    for bm, bn, bk, splits, warps, stages in itertools.product((64, 128), (64, 128), (64, 128), (2, 4, 8), (4, 8),
                                                               (3, 4)):
        if (bm * bk + bn * bk) * 2 * stages > 220_000 or bm > max(64, rows) or (bm == 128) != (warps == 8):
            continue
        tile = (bm, bn, bk, splits, warps, stages, True)
        try:
            diff = float((split_k.partials(a, dw, tile=tile).sum(0) - ref).abs().max())
            results.append((device_us(lambda: split_k.partials(a, dw, tile=tile)), tile[:6], diff))
        except Exception as exc:
            print(f"    tile {tile}: {type(exc).__name__}: {str(exc)[:120]}")
    results.sort()
    print(f"  down partials with TMA: {len(results)} tiles ran; the fastest 6 (BLOCK_M, BLOCK_N, BLOCK_K, splits, "
          "warps, stages)")
    for us, cfg, diff in results[:6]:
        report(f"  tile {cfg}, diff {diff:.3g}", us, dw.numel() * 2)


def _kv_caches(rows: int, kv_heads: int, length: int, dim: int, gen: torch.Generator,
               fp8: bool) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict]:
    """Five layers' random (keys, values) [rows, kv_heads, length, dim]: bf16, or e4m3 (values of
    about N(0, 1) under scales near 1/64, unlike per head), with the `rope_store_attend` keyword
    arguments that go with them (the scales; none for bf16)."""
    def one():
        x = torch.randn(rows, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        return (x * 64).clamp(-448, 448).to(torch.float8_e4m3fn) if fp8 else x
    caches = [(one(), one()) for _ in range(5)]
    scales = torch.linspace(1.0, 1.5, kv_heads, device="cuda") / 64
    return caches, ({"k_scale": scales, "v_scale": scales.flip(0).contiguous()} if fp8 else {})


def attention_probe(rows: int, fp8: bool = False) -> None:
    """Where the attention kernel's time goes: at equal positions (as in a generation step, where
    every row has the same length), the kernel against a kernel that only reads the same keys and
    values (`_kv_read_probe`) and a torch sum over the same bytes; `fp8`: on an FP8 cache."""
    from rl_core.generation.native import decode_attention

    heads, kv_heads, dim, length = 14, 2, 64, 512
    gen = torch.Generator(device="cuda").manual_seed(rows)
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    cos, sin = torch.randn(2, rows, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    caches, scales = _kv_caches(rows, kv_heads, length, dim, gen, fp8)
    element = caches[0][0].element_size()
    out = torch.empty(rows * kv_heads, device="cuda")

    def cycling(fn):
        turn = [0]

        def once():
            turn[0] += 1
            return fn(*caches[turn[0] % len(caches)])
        return once

    for pos in (128, 192, 320):
        positions = torch.full((rows,), pos, device="cuda", dtype=torch.long)
        nbytes = rows * pos * kv_heads * dim * element * 2
        print(f"Attention probe, rows {rows}, every position {pos}, {'FP8' if fp8 else 'bf16'} cache "
              "(KV bytes read per call)")
        for tile in ((64, 4, 3), (128, 4, 3), (64, 4, 4), (64, 8, 3), (32, 4, 4)):
            report(f"rope_store_attend, tile {tile}", device_us(cycling(
                lambda k, v: decode_attention.rope_store_attend(qkv, cos, sin, positions, k, v, heads, kv_heads,
                                                                tile=tile, **scales))), nbytes)
        for block_n, warps, stages in ((64, 4, 3), (128, 4, 3), (64, 4, 4), (256, 8, 3)):
            report(f"read-only probe, {block_n} keys a step, {warps} warps, {stages} stages", device_us(cycling(
                lambda k, v: _kv_read_probe[(rows, kv_heads)](positions, k, v, out, k.stride(0), k.stride(1),
                                                              k.stride(2), DIM=dim, BLOCK_N=block_n,
                                                              num_warps=warps, num_stages=stages))), nbytes)
        report("torch: sum of the same keys and values", device_us(cycling(
            lambda k, v: torch.add(k.view(torch.uint8)[:, :, :pos].sum(dtype=torch.int64),  # the bytes, as integers
                                   v.view(torch.uint8)[:, :, :pos].sum(dtype=torch.int64)) if fp8 else
            torch.add(k[:, :, :pos].sum(dtype=torch.float32), v[:, :, :pos].sum(dtype=torch.float32)))),
            nbytes)


def attention(rows: int, mean_position: int = 192, fp8: bool = False) -> None:
    """The RoPE + cache-write + attention kernel at the Qwen2.5-0.5B head shape, positions spread
    evenly around `mean_position` (generation_gpu.py's mean at 64 + 256 / 2), at each tile of
    `decode_attention.TILES` (the first is the default); `fp8`: on an FP8 (e4m3) cache."""
    from rl_core.generation.native import decode_attention

    heads, kv_heads, dim = 14, 2, 64
    length = max(512, 2 * mean_position)  # positions reach 5/3 of the mean
    gen = torch.Generator(device="cuda").manual_seed(rows)
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    cos, sin = torch.randn(2, rows, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    positions = torch.linspace(mean_position // 3, 5 * mean_position // 3, rows, device="cuda").long()
    # Five layers' caches, called in turn, so that a call does not find its keys in L2 (as in a step,
    # where 24 layers' weights and caches pass through between two calls of one layer).
    caches, scales = _kv_caches(rows, kv_heads, length, dim, gen, fp8)
    nbytes = int(positions.sum()) * kv_heads * dim * caches[0][0].element_size() * 2  # keys and values read
    print(f"Decode attention, rows {rows}, positions {int(positions.min())}..{int(positions.max())}, "
          f"{'FP8' if fp8 else 'bf16'} cache (KV bytes read per call)")

    def call(**kw):
        turn = [0]

        def once():
            k_cache, v_cache = caches[turn[0] % len(caches)]
            turn[0] += 1
            return decode_attention.rope_store_attend(qkv, cos, sin, positions, k_cache, v_cache, heads, kv_heads,
                                                      **scales, **kw)
        return once

    ref = call()()
    for tile in decode_attention.TILES:
        same = float((call(tile=tile)().float() - ref.float()).abs().max()) < 0.05
        report(f"tile {tile} (keys a step, warps, stages){'' if same else ' (DIFFERS)'}", device_us(call(tile=tile)),
               nbytes)


def _tile_sweep(call, ref, tiles, top: int = 5, label: str = "") -> list:
    """Time `call(tile)` (float32 partials) at each tile; print the fastest `top` with the max |diff| of
    their sum to `ref`."""
    results = []
    for tile in tiles:
        try:
            diff = float((call(tile).sum(0) - ref.float()).abs().max())
            results.append((device_us(lambda: call(tile)), tile, diff))
        except Exception as exc:  # out of shared memory or registers: not a candidate
            print(f"    tile {tile}: {type(exc).__name__}")
    results.sort()
    print(f"  {label}: {len(results)} tiles ran; the fastest {top} (BLOCK_M, BLOCK_N, BLOCK_K, splits, warps, "
          "stages; max |diff| to the reference)")
    for us, tile, diff in results[:top]:
        print(f"    {str(tile):<28} {us:8.2f} us   diff {diff:.3g}", flush=True)
    return results


def splitk(rows: int, sweep: bool = False) -> None:
    """The output and down projections as split-K partials summed in the add + norm kernel
    (split_k.py, what the fused stack runs) against cuBLAS + its reduce + the compiled add + norm.
    `sweep`: the partials at a grid of tiles too (the fastest printed)."""
    import itertools

    from rl_core.generation.native import split_k
    from rl_core.generation.native.decode_graph import _compiled
    from rl_core.generation.native.fused_stack import down_add_norm, partials_add_norm
    from rl_core.generation.native.model import attention_output_norm

    eps = 1e-6
    gen = torch.Generator(device="cuda").manual_seed(rows)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * scale

    x, ln = rand(rows, HIDDEN), rand(HIDDEN, scale=0.1) + 1
    down_w, o_w = rand(HIDDEN, MLP, scale=MLP ** -0.5), rand(HIDDEN, HIDDEN, scale=HIDDEN ** -0.5)
    gated, out = rand(rows, MLP), rand(rows, HIDDEN)
    closing = _compiled(down_add_norm, unfused_residual=True)
    output_norm = _compiled(attention_output_norm, unfused_residual=True)
    compiled_sum = _compiled(partials_add_norm, unfused_residual=True)
    bms = (64, 128) if rows > 64 else (16, 32, 64)

    def tiles(splits, stages=(3, 4)):
        for bm, bn, bk, s, st in itertools.product(bms, (32, 64, 128), (64, 128), splits, stages):
            if (bm * bk + bk * bn) * 2 * st <= 200_000:
                yield bm, bn, bk, s, 8 if bm == 128 else 4, st

    print(f"Split-K projections, rows {rows} (float32 partials summed by the add + norm)")
    for name, a, w, splits, stack_now in (("down", gated, down_w, (2, 4, 8), lambda: closing(x, gated, down_w, None, ln, eps)),
                                          ("output", out, o_w, (1, 2, 4, 7), lambda: output_norm(x, out, o_w, None, ln, eps))):
        nbytes = w.numel() * 2
        report(f"{name}: cuBLAS alone", device_us(lambda: F.linear(a, w)), nbytes)
        report(f"{name}: cuBLAS + compiled add + norm (SPLIT_K off)", device_us(stack_now), nbytes)
        report(f"{name}: split_k.partials alone, default tile", device_us(lambda: split_k.partials(a, w, kind=name)),
               nbytes)
        parts = split_k.partials(a, w, kind=name)
        ref_x, ref_n = partials_add_norm(x, parts, None, ln, eps)
        for tile in ((1, 4), (2, 4), (1, 8), (4, 8)):
            gx, gn = split_k.add_norm(x, parts, None, ln, eps, tile=tile)
            diff = max(float((gx.float() - ref_x.float()).abs().max()), float((gn.float() - ref_n.float()).abs().max()))
            report(f"{name}: split_k.add_norm alone, (rows, warps) {tile}, diff {diff:.3g}",
                   device_us(lambda: split_k.add_norm(x, parts, None, ln, eps, tile=tile)), parts.numel() * 4)
        report(f"{name}: the sum compiled into the add + norm (dropped)",
               device_us(lambda: compiled_sum(x, parts, None, ln, eps)), parts.numel() * 4)
        report(f"{name}: partials + add_norm (SPLIT_K on)",
               device_us(lambda: split_k.add_norm(x, split_k.partials(a, w, kind=name), None, ln, eps)), nbytes)
        if sweep:
            _tile_sweep(lambda t: split_k.partials(a, w, tile=t), F.linear(a, w), list(tiles(splits)),
                        label=f"{name}: split_k.partials alone")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--sweep", action="store_true",
                        help="also time gate_up_silu at a grid of explicit tiles, and the other projections "
                             "against Inductor's max-autotune (minutes: compiles every tile)")
    parser.add_argument("--only-sweep", action="store_true", help="the sweep alone")
    parser.add_argument("--parts", nargs="+", choices=["mlp", "attention", "attention-fp8", "sampling", "splitk",
                                                       "attention-probe", "attention-probe-fp8", "tma", "lmhead"],
                        default=["mlp", "attention", "sampling"], help="which kernels to time (default: all)")
    parser.add_argument("--mean-position", type=int, default=192,
                        help="attention parts: rows' positions spread evenly over a third to five thirds of this "
                             "(default 192, generation_gpu.py's 64-token prompts + 256 new tokens; e.g. 2048 for "
                             "long rollouts)")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for rows in args.rows:
        if not args.only_sweep:
            for part in args.parts:
                {"mlp": mlp, "attention": lambda r: attention(r, args.mean_position), "sampling": sampling, "splitk": lambda r: splitk(r, args.sweep or args.only_sweep),
                 "attention-probe": attention_probe, "tma": tma, "lmhead": lm_head,
                 "attention-fp8": lambda r: attention(r, args.mean_position, fp8=True),
                 "attention-probe-fp8": lambda r: attention_probe(r, fp8=True)}[part](rows)
        if args.sweep or args.only_sweep:
            sweep_gate_up(rows)
            projections(rows)


if __name__ == "__main__":
    main()
