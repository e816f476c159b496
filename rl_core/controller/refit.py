"""Refit: moving the trainer's new weights into the generation backends.

Owns: the refit modes, their timing and byte counts:
- `in_flight`: swap while generations run; each token records the version that made it.
- `drain`: close dispatch (`PumpLedger.draining`), let in-flight generations finish, swap,
  reopen: no sample spans two versions.
- `barrier` (reproducible runs): before leaving version v, wait until every group that may
  be generated with version v (target steps <= v + the sampler's `lookahead_at(v)`) has been
  dispatched and committed (the buffer holds no reserved slot for those steps); then swap.
Both read only what the pumps share: the ledger, the buffer and the sampler.

Does not own: the transport (`rl_core.weights`), or when to refit (train pump).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from rl_core.buffer.replay_buffer import ReplayBuffer
    from rl_core.controller.ledger import PumpLedger
    from rl_core.protocols import GenerationBackend, TrainerBackend, WeightSync
    from rl_core.samplers.base import Sampler

MODES = ("in_flight", "drain", "barrier")


class Refitter:
    def __init__(self, backends: Iterable[GenerationBackend], trainer: TrainerBackend, mode: str = "in_flight", *,
                 ledger: PumpLedger | None = None, buffer: ReplayBuffer | None = None, sampler: Sampler | None = None,
                 recompute_kv: bool = False, sync: WeightSync | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown refit mode {mode!r}; expected one of {MODES}")
        if mode != "in_flight" and (ledger is None or buffer is None or sampler is None):
            raise ValueError(f"refit mode {mode!r} waits on the pumps: it needs the ledger, the buffer and the sampler")
        from rl_core.weights import InProcessSync

        self.sync: WeightSync = sync if sync is not None else InProcessSync()  # transport: rl_core.weights
        self.backends = list(backends)
        self.trainer = trainer
        self.ledger = ledger
        self.buffer = buffer
        self.sampler = sampler
        self.mode = mode
        self.recompute_kv = recompute_kv
        self.count = 0

    def _committed_through(self, step: int) -> bool:
        """Every group for target steps <= `step` is dispatched and committed (or no more can be
        dispatched: the run's dispatch has ended or reached the dispatch limit)."""
        nxt = self.sampler.next_target_step()
        all_dispatched = nxt > step or self.ledger.exhausted or nxt >= self.ledger.dispatch_limit
        return all_dispatched and not any(s.target_step is not None and s.target_step <= step
                                          for s in self.buffer.reserved())

    async def _wait(self, predicate) -> None:
        """Wait on the shared condition until `predicate()` (or a group task's failure, raised)."""
        ledger = self.ledger
        await self.buffer.wait_for(lambda: ledger.failure is not None or predicate())
        if ledger.failure is not None:
            raise ledger.failure

    async def refit(self, version: int) -> dict[str, float]:
        """Publish weights `version` (= the trainer's new version) to every backend."""
        t0 = time.monotonic()
        if self.mode == "barrier":
            # groups pinned to the outgoing version v = version - 1 are those of steps <= v + lookahead
            reach = version - 1 + self.sampler.lookahead_at(version - 1)
            await self._wait(lambda: self._committed_through(reach))
        elif self.mode == "drain":
            self.ledger.draining = True
            await self.buffer.notify()
            await self._wait(lambda: not self.ledger.inflight)
        wait_s = time.monotonic() - t0
        try:
            t_export = time.monotonic()
            # a transport that sends from the trainer's GPU takes the weights where they are
            weights = (self.trainer.export_weights(on_device=True) if self.sync.sends_from_device
                       else self.trainer.export_weights())
            if getattr(self.sync, "keeps_latest", False) and getattr(self.trainer, "exports_live_tensors", False):
                from rl_core.weights import snapshot  # the transport keeps them past the next step

                weights = snapshot(weights)
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
                self.ledger.draining = False
                await self.buffer.notify()
        self.count += 1
        return {"seconds": time.monotonic() - t0, "wait_s": wait_s, "export_s": export_s, "update_s": update_s,
                "bytes": float(nbytes),
                "bytes_per_s": nbytes / update_s if update_s > 0 else 0.0,
                **{f"sync_{k}": float(v) for k, v in report.parts.items()}}
