"""The weight-sync seam: one `push(version, weights, backends)` per refit, and its report.

Owns: `SyncReport` (bytes moved, seconds, and the parts of the time), the in-process
transport, and `make_weight_sync` (the recipe's `trainer.weight_sync` -> a transport).
Does not own: when to refit or the drain modes (`rl_core.controller.refit`), or loading
into an engine (each backend's `update_weights`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

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


class InProcessSync:
    """`trainer.weight_sync.type: in_process`: engines in this process copy the tensors directly."""

    kind = "in_process"
    sends_from_device = False  # every transport says whether refit exports onto the trainer's GPU for it

    async def push(self, version: int, weights: Mapping[str, torch.Tensor], backends: Iterable) -> SyncReport:
        t0 = time.monotonic()
        for backend in backends:
            await backend.update_weights(version, weights)
        return SyncReport(self.kind, version, state_dict_bytes(weights), time.monotonic() - t0)


def make_weight_sync(cfg, run_dir: str | Path):
    """The recipe's weight transport (`trainer.weight_sync`)."""
    ws = cfg.trainer.weight_sync
    if ws.type == "in_process":
        return InProcessSync()
    if ws.type == "filesystem":
        from rl_core.weights.filesystem import FilesystemWeightSync

        root = Path(ws.dir) if ws.dir else Path(run_dir) / "weights"
        return FilesystemWeightSync(root, keep_last_versions=ws.keep_last_versions)
    if ws.type == "broadcast":  # trainer rank 0's device (set by init_distributed before this runs)
        from rl_core.weights.broadcast import BroadcastWeightSync

        cuda = cfg.runtime.device != "cpu" and torch.cuda.is_available()
        device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
        return BroadcastWeightSync(device, ws.bucket_size_mb, cfg.trainer.collective_timeout_s)
    raise ValueError(f"unknown trainer.weight_sync.type {ws.type!r}")
