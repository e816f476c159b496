"""Refit: moving the trainer's new weights into the generation backends.

Owns: the refit modes, their timing and byte counts:
- `in_flight`: swap while generations run; each token records the version that made it.
- `drain`: close dispatch, let in-flight generations finish, swap, reopen: no sample spans
  two versions.
- `barrier` (reproducible runs): before leaving version v, wait until every group that
  may be generated with version v (target steps <= v + lookahead) has been dispatched and
  committed; then swap. Each step's groups are thus generated with exactly one, known
  version, whatever the timing.

Does not own: the transport (each backend's `update_weights` takes a state dict or a
directory; `rl_core.weights` owns filesystem/NCCL handoff), or when to refit (train pump).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from rl_core.controller.rollout_pump import RolloutPump
    from rl_core.protocols import GenerationBackend, TrainerBackend, WeightSync

MODES = ("in_flight", "drain", "barrier")


class Refitter:
    def __init__(self, backends: Iterable[GenerationBackend], trainer: TrainerBackend, rollout: RolloutPump,
                 mode: str = "in_flight", lookahead: int | Callable[[int], int] = 0,
                 recompute_kv: bool = False, sync: WeightSync | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown refit mode {mode!r}; expected one of {MODES}")
        from rl_core.weights import InProcessSync

        self.sync: WeightSync = sync if sync is not None else InProcessSync()  # transport: rl_core.weights
        self.backends = list(backends)
        self.trainer = trainer
        self.rollout = rollout
        self.mode = mode
        self.lookahead = lookahead
        self.recompute_kv = recompute_kv
        self.count = 0

    async def refit(self, version: int) -> dict[str, float]:
        """Publish weights `version` (= the trainer's new version) to every backend."""
        t0 = time.monotonic()
        if self.mode == "barrier":
            # groups pinned to the outgoing version v = version - 1 are those of steps <= v + lookahead
            la = self.lookahead(version - 1) if callable(self.lookahead) else self.lookahead
            await self.rollout.wait_committed_through(version - 1 + la)
        elif self.mode == "drain":
            await self.rollout.set_dispatch_open(False)
            await self.rollout.wait_idle()
        wait_s = time.monotonic() - t0
        try:
            t_export = time.monotonic()
            # a transport that sends from the trainer's GPU takes the weights where they are
            weights = (self.trainer.export_weights(on_device=True) if self.sync.sends_from_device
                       else self.trainer.export_weights())
            t1 = time.monotonic()
            export_s = t1 - t_export
            report = await self.sync.push(version, weights, self.backends)
            nbytes = report.bytes
            if self.recompute_kv:
                for backend in self.backends:
                    await backend.invalidate_kv_cache()
            update_s = time.monotonic() - t1
        finally:
            if self.mode == "drain":
                await self.rollout.set_dispatch_open(True)
        self.count += 1
        return {"seconds": time.monotonic() - t0, "wait_s": wait_s, "export_s": export_s, "update_s": update_s,
                "bytes": float(nbytes),
                "bytes_per_s": nbytes / update_s if update_s > 0 else 0.0,
                **{f"sync_{k}": float(v) for k, v in report.parts.items()}}
