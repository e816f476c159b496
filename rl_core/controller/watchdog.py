"""The stall watchdog: a run that stops making progress is reported, never a silent hang.

Owns: checking every `interval_s` whether the run progressed (a group committed, a group
selected, or an RL step finished), and after `stall_timeout_s` without progress producing
a report that names what each pump is waiting on, the buffer's state and the generation
backend's counters; then warning or stopping the run (StallError carrying the report).

Does not own: the pumps' behaviour; it only reads their `waiting_on` and counters.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl_core.errors import StallError

if TYPE_CHECKING:
    from rl_core.buffer.replay_buffer import ReplayBuffer
    from rl_core.config.controller_sections import WatchdogConfig
    from rl_core.controller.rollout_pump import RolloutPump
    from rl_core.controller.train_pump import TrainPump
    from rl_core.protocols import GenerationBackend, TrainerBackend


@dataclass(eq=False)
class Watchdog:
    """Reads the pumps, the buffer, the backend and the trainer it is given; counts its stalls."""

    cfg: WatchdogConfig  # async_rl.watchdog
    rollout: RolloutPump
    train: TrainPump
    buffer: ReplayBuffer
    backend: GenerationBackend
    trainer: TrainerBackend
    stalls: int = 0  # stalls reported so far

    def _progress(self) -> tuple:
        return (self.rollout.stats.committed_groups, self.rollout.stats.dropped_groups,
                self.train.selected_in_step, self.trainer.version, self.train.train_retries)

    def report(self, stalled_s: float) -> str:
        try:
            gen = self.backend.metrics()
            gen_txt = ", ".join(f"{k}={gen[k]:g}" for k in ("running", "waiting", "requests_finished") if k in gen)
        except Exception as exc:  # noqa: BLE001 - the report must not fail
            gen_txt = f"unavailable ({exc})"
        return (f"no progress for {stalled_s:.0f}s (async_rl.watchdog.stall_timeout_s={self.cfg.stall_timeout_s:g}). "
                f"Rollout pump waits on: {self.rollout.waiting_on}; {len(self.rollout.inflight)} groups in flight. "
                f"Train pump waits on: {self.train.waiting_on}; trainer at weight version {self.trainer.version}. "
                f"Buffer: {self.buffer.live()}/{self.buffer.capacity} live slots, {len(self.buffer.ready())} ready. "
                f"Generation backend: {gen_txt}.")

    async def run(self) -> None:
        last, t_last = self._progress(), time.monotonic()
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            now, cur = time.monotonic(), self._progress()
            if cur != last:
                last, t_last = cur, now
                continue
            if now - t_last >= self.cfg.stall_timeout_s:
                self.stalls += 1
                text = self.report(now - t_last)
                if self.cfg.action == "abort":
                    raise StallError(text)
                print(f"[watchdog] {text}", file=sys.stderr, flush=True)
                t_last = now
