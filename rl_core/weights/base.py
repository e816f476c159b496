"""What every weight transport shares: the byte count of a state dict.

Owns: `state_dict_bytes`. Each transport reports a `rl_core.types.SyncReport` (bytes moved,
seconds, and the parts of the time).
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
