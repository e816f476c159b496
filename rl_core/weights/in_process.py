"""The `in_process` weight transport: engines in this process take the trainer's tensors directly.

Owns: `InProcessSync` (the embedded default; no copy beyond what each backend's
`update_weights` does). Does not own: when to refit (`rl_core.controller.refit`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable, Mapping

import torch

from rl_core.types import SyncReport
from rl_core.weights.base import state_dict_bytes


class InProcessSync:
    """`trainer.weight_sync.type: in_process`: engines in this process copy the tensors directly."""

    kind = "in_process"
    sends_from_device = False  # every transport says whether refit exports onto the trainer's GPU for it

    @classmethod
    def from_recipe(cls, cfg, run_dir: str | Path) -> "InProcessSync":
        """The registry's builder (`rl_core.weights.WEIGHT_SYNCS`)."""
        return cls()

    async def push(self, version: int, weights: Mapping[str, torch.Tensor], backends: Iterable) -> SyncReport:
        t0 = time.monotonic()
        for backend in backends:
            await backend.update_weights(version, weights)
        return SyncReport(self.kind, version, state_dict_bytes(weights), time.monotonic() - t0)
