"""Triton for the native engine's fused kernels: the optional import and the interpreter switch.

Owns: `triton` / `tl` (None when the package is missing: the CPU build of torch has none),
and `interpreting()` (Triton's CPU interpreter, `TRITON_INTERPRET=1`,
which the CPU tests use to run the kernels without a GPU).

Does not own: the kernels (decode_attention.py, fused_sampling.py, fused_mlp.py) or the
checks of when they may run (decode_attention.check_supported).
"""

from __future__ import annotations

import os

try:  # triton ships with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) computes bf16/fp16 dots wrongly (triton
    3.9), so there the dots run in float32 from the same rounded inputs: the same products
    (exact in float32) accumulated in float32, as the tensor cores do."""
    return os.environ.get("TRITON_INTERPRET") == "1"
