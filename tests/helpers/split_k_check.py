"""The split-K projection kernels (split_k.partials, split_k.add_norm) against torch, on any device
the kernels run on (CUDA, or the CPU under TRITON_INTERPRET=1): shared by the unit and GPU tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.helpers.interpreted import print_gaps

# (rows, k, n, splits, bias): ragged tiles and slices, one row, one slice, more slices than blocks
CASES = ((5, 96, 40, 3, False), (33, 200, 70, 4, True), (1, 64, 32, 1, False), (9, 40, 24, 8, True))
QWEN = ((256, 4864, 896, None, False), (256, 896, 896, None, True), (64, 4864, 896, None, False),
        (64, 896, 896, None, True))


def compare(device: str, dtype: torch.dtype, rows: int, k: int, n: int, splits: int | None,
            bias: bool, tma: bool = False) -> dict:
    """Relative gaps of (the summed partials and `split_k.linear` against F.linear; add_norm's x and normed rows against
    `fused_stack.partials_add_norm` on the same partials, and its x without a norm). `tma`: the
    partials through the TMA-descriptor kernel at a small tile (else the tile `split_k` picks)."""
    from rl_core.generation.native import split_k
    from rl_core.generation.native.fused_stack import partials_add_norm

    gen = torch.Generator().manual_seed(rows * 13 + k)
    a = torch.randn(rows, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    x = torch.randn(rows, n, generator=gen).to(device, dtype)
    ln = (1 + 0.1 * torch.randn(n, generator=gen)).to(device, dtype)
    tile = (16, 32, 32, splits or 2, 4, 2, True) if tma else None
    parts = split_k.partials(a, w, splits, kind="down" if k > n else "output", tile=tile)
    assert parts.dtype == torch.float32 and parts.shape[1:] == (rows, n)

    def rel(got, ref):
        return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()

    lin = split_k.linear(a, w, b, tile=None if tile is None else tile[:3] + (1,) + tile[4:])
    assert lin.dtype == dtype and lin.shape == (rows, n)
    got_x, got_n = split_k.add_norm(x, parts, b, ln, 1e-6)
    ref_x, ref_n = partials_add_norm(x, parts, b, ln, 1e-6)
    plain_x, none = split_k.add_norm(x, parts, b, None, 1e-6)
    assert none is None and got_x.dtype == dtype and got_n.dtype == dtype
    return {"matmul": rel(split_k.summed(parts, b, dtype), F.linear(a, w, b)), "linear": rel(lin, F.linear(a, w, b)),
            "x": rel(got_x, ref_x),
            "normed": rel(got_n, ref_n), "x_no_norm": rel(plain_x, ref_x), "splits": parts.shape[0]}


def check(dtype: torch.dtype, gaps: dict) -> None:
    """float32: the same sums in another order; bf16/fp16: the matmul one unit in the last place of
    the rounded output (cuBLAS sums in another order), add + norm bit-equal to the torch form up to
    the square root's rounding."""
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert gaps["matmul"] < tol and gaps["linear"] < tol, gaps
    assert max(gaps["x"], gaps["normed"], gaps["x_no_norm"]) < (1e-6 if dtype == torch.float32 else 2 ** -7), gaps


if __name__ == "__main__":  # one JSON line per comparison (the unit test runs this under TRITON_INTERPRET=1)
    import sys

    where = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    print_gaps(compare, CASES, where)
