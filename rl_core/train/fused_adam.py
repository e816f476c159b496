"""torch's AdamW as its fused CUDA kernel for the sharded backends' optimizers.

Owns: `fused_adamw`, which switches an existing torch Adam/AdamW to `fused=True` (one pass
over weights, gradients and moments instead of the ~10 multi-tensor passes of torch's default
`foreach` implementation; the same AdamW update, rounded in another order), also after a
state saved unfused is loaded. Used by Megatron's optimizer (without Transformer Engine or Apex
its fallback is `torch.optim.AdamW` with torch's default, the multi-tensor update) and by
fsdp2's `ShardLocalAdamW` over fp32 master weights: about half the update's time in both
(docs/benchmarks.md). The torch backend builds its AdamW fused itself.
Does not own: building the optimizers, their state dicts or checkpoints.
"""

from __future__ import annotations

import torch


def fused_adamw(inner: torch.optim.Optimizer) -> None:
    """`inner` (torch's Adam or AdamW) switched to torch's fused kernel, when all its weights are on CUDA.

    The flag is set on each parameter group (what `step` reads) and the step counters are moved
    to the weights' device as float32 tensors, as torch keeps them for the fused kernel. Also
    what a state loaded from a checkpoint needs: loading brings back the saved groups' flags
    (unfused for a state saved before, or on the CPU) and host-side step counters. A no-op for
    other optimizers and off CUDA (the CPU keeps its numerics and tests)."""
    if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return
    params = [p for group in inner.param_groups for p in group["params"]]
    if not params or not all(p.is_cuda and p.is_floating_point() for p in params):
        return
    for group in inner.param_groups:
        group["fused"], group["foreach"] = True, False
    inner.defaults["fused"], inner.defaults["foreach"] = True, False
    for p in params:
        state = inner.state.get(p)
        if state and "step" in state and not (torch.is_tensor(state["step"]) and state["step"].device == p.device):
            state["step"] = torch.as_tensor(state["step"], dtype=torch.float32, device=p.device)
