"""Refit: moving the trainer's new weights into the generation backends.

Owns: the refit modes (`in_flight`: swap while generations run, each token records the
version that produced it; `drain`: close dispatch, let in-flight generations finish, swap,
reopen, so no sample spans two versions), the timing and byte counts of each refit.

Does not own: the transport (each backend's `update_weights` takes a state dict or a
directory; `rl_core.weights` owns filesystem/NCCL handoff), or when to refit (train pump).
"""

from __future__ import annotations

import time


class Refitter:
    def __init__(self, backends, trainer, rollout, mode: str = "in_flight"):
        if mode not in ("in_flight", "drain"):
            raise ValueError(f"unknown refit mode {mode!r}")
        self.backends = list(backends)
        self.trainer = trainer
        self.rollout = rollout
        self.mode = mode
        self.count = 0

    async def refit(self, version: int) -> dict[str, float]:
        t0 = time.monotonic()
        drain_s = 0.0
        if self.mode == "drain":
            await self.rollout.set_dispatch_open(False)
            await self.rollout.wait_idle()
            drain_s = time.monotonic() - t0
        try:
            weights = self.trainer.export_weights()
            nbytes = sum(t.numel() * t.element_size() for t in weights.values())
            t1 = time.monotonic()
            for backend in self.backends:
                await backend.update_weights(version, weights)
            update_s = time.monotonic() - t1
        finally:
            if self.mode == "drain":
                await self.rollout.set_dispatch_open(True)
        self.count += 1
        total = time.monotonic() - t0
        return {"seconds": total, "drain_s": drain_s, "update_s": update_s, "bytes": float(nbytes),
                "bytes_per_s": nbytes / update_s if update_s > 0 else 0.0}
