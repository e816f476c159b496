"""What every weight transport shares: the byte count of a state dict and its snapshot.

Owns: `state_dict_bytes` and `snapshot` (copies a transport may keep while the trainer's own
tensors move on). Each transport reports a `rl_core.types.SyncReport`.
The transport's contract is `rl_core.protocols.WeightSync` (one `push(version, weights,
backends)` per refit); the implementations are one module each (`in_process`, `filesystem`,
`broadcast`) and the registry is `rl_core.weights.WEIGHT_SYNCS`.
Does not own: when to refit or the drain modes (`rl_core.controller.refit`), or loading
into an engine (each backend's `update_weights`).
"""

from __future__ import annotations

from typing import Mapping

import torch


def state_dict_bytes(weights: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the distinct tensors of a state dict (tied weights counted once)."""
    seen: dict[tuple[int, int], int] = {}
    for t in weights.values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.device.type != "meta" else (id(t), 0)
        seen[key] = t.numel() * t.element_size()
    return sum(seen.values())


def snapshot(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of `weights` on their devices, tied tensors still one tensor (a trainer whose
    export is its live parameters would otherwise change what a transport keeps)."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}
    for name, t in weights.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen[key] = t.detach().clone()
        out[name] = seen[key]
    return out
