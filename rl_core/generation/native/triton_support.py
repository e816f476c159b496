"""Triton for the native engine's fused kernels: the optional import and the interpreter switch.

Owns: `triton` / `tl` (None when the package is missing: the CPU build of torch has none),
`interpreting()` (Triton's CPU interpreter, `TRITON_INTERPRET=1`,
which the CPU tests use to run the kernels without a GPU), and `tma_usable` / `descriptor`: whether
tensors can be read through the Hopper tensor-memory accelerator (TMA) and their host descriptors;
`ROWS_FIRST`: the order in which the TMA matmul kernels number their programs;
`pdl(tensor)` / `pdl_flags(tensor)` / `PDL` and the kernels' `gdc_wait` / `gdc_launch_dependents`: programmatic dependent
launch (Hopper), under which a kernel is launched while the one before it finishes and waits for
it (`gdc_wait`, before any load or store) instead of the launch waiting (NVIDIA, CUDA C++
Programming Guide, "Programmatic Dependent Launch and Synchronization").

Does not own: the kernels (decode_attention.py, fused_sampling.py, fused_mlp.py, split_k.py) or the
checks of when they may run (decode_attention.check_supported).
"""

from __future__ import annotations

import os

import torch

try:  # triton ships with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

try:  # host TMA descriptors (triton 3.3+)
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # pragma: no cover - no triton, or an older one
    TensorDescriptor = None

try:  # grid dependency control (triton 3.4+); the kernels only call these when launched with PDL
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    from triton.backends.nvidia.compiler import CUDAOptions

    _HAS_PDL = "launch_pdl" in CUDAOptions.__dataclass_fields__
except Exception:  # pragma: no cover - no triton, or an older one
    gdc_launch_dependents = gdc_wait = None
    _HAS_PDL = False

# Programmatic dependent launch of the fused decode step's Triton kernels where `pdl` allows it: a
# module switch for benchmarks (bench/generation_gpu.py --no-pdl) and tests; read at each launch,
# so it is fixed into a CUDA graph when the graph is captured.
PDL = True

# The TMA matmul kernels (fused_mlp's gate/up + SiLU, split_k's partials) number their programs row
# block first, so that the programs sharing a weight tile run side by side and read it once from
# memory (program_id(0) over row blocks, 1 over column blocks). A module switch for benchmarks
# (bench/generation_gpu.py +colsfirst), read at each launch.
ROWS_FIRST = True


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) computes bf16/fp16 dots wrongly (triton
    3.9), so there the dots run in float32 from the same rounded inputs: the same products
    (exact in float32) accumulated in float32, as the tensor cores do."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def tma_usable(*tensors) -> bool:
    """Whether kernels may load these 2-D tensors through TMA descriptors: CUDA compute capability 9+
    (Hopper), a triton with host tensor descriptors, row-major tensors whose base and row stride are
    16-byte aligned (the descriptor's rules). The interpreter runs descriptors too, for the tests."""
    if TensorDescriptor is None:
        return False
    t0 = tensors[0]
    if not interpreting() and (t0.device.type != "cuda" or torch.cuda.get_device_capability(t0.device)[0] < 9):
        return False
    return all(t.dim() == 2 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in tensors)


def descriptor(t, block: list[int]):
    """The host TMA descriptor of a 2-D tensor read in `block`-shaped tiles (out-of-range reads give zeros)."""
    return TensorDescriptor.from_tensor(t, block)


def pdl(t) -> bool:
    """Whether a kernel reading `t` launches with programmatic dependent launch: `PDL` on, a CUDA
    device of compute capability 9+, a triton that has it (not its interpreter)."""
    return (PDL and _HAS_PDL and not interpreting() and t.device.type == "cuda"
            and torch.cuda.get_device_capability(t.device)[0] >= 9)


def pdl_flags(t) -> dict:
    """A kernel launch's PDL arguments for a kernel reading `t`: its `PDL` constexpr, and Triton's
    `launch_pdl` option where `pdl(t)`."""
    on = pdl(t)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
