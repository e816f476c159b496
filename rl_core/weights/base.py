"""What every weight transport shares: its report and the byte count of a state dict.

Owns: `SyncReport` (bytes moved, seconds, and the parts of the time) and `state_dict_bytes`.
The transport's contract is `rl_core.protocols.WeightSync` (one `push(version, weights,
backends)` per refit); the implementations are one module each (`in_process`, `filesystem`,
`broadcast`) and the registry is `rl_core.weights.WEIGHT_SYNCS`.
Does not own: when to refit or the drain modes (`rl_core.controller.refit`), or loading
into an engine (each backend's `update_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch


def state_dict_bytes(weights: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the distinct tensors of a state dict (tied weights counted once)."""
    seen: dict[tuple[int, int], int] = {}
    for t in weights.values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.device.type != "meta" else (id(t), 0)
        seen[key] = t.numel() * t.element_size()
    return sum(seen.values())


@dataclass
class SyncReport:
    """What one weight sync moved and how long it took."""

    kind: str
    version: int
    bytes: int
    seconds: float
    parts: dict[str, float] = field(default_factory=dict)  # e.g. write_s, load_s, send_s

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def as_metrics(self) -> dict[str, float]:
        out = {"bytes": float(self.bytes), "update_s": self.seconds, "bytes_per_s": self.bytes_per_s}
        out.update(self.parts)
        return out
