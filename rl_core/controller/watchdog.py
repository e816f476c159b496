"""The stall watchdog: a run that stops making progress is reported, never a silent hang.

Owns: checking every `interval_s`, from a thread of its own, whether the run progressed (a group
committed, a group selected, or an RL step finished), and after `stall_timeout_s` without progress
a report naming what each pump waits on, the buffer's state and the generation backend's counters
(then warning or stopping the run: StallError); and whether the controller's event loop and each
user loop (rl_core.usercode.UserLoop: agents) still run callbacks: a user loop blocked for
`block_timeout_s` stops the run with `BlockedLoopError` naming the user's function and file:line
on its stack; the controller's loop is named then in a warning and stopped at `stall_timeout_s`,
ending the process (`usercode.hard_exit`), since no error can reach a blocked loop.

Does not own: the pumps' behaviour; it only reads their `waiting_on` and counters.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl_core.errors import StallError
from rl_core.usercode import BlockedLoopError, Heartbeat, hard_exit, stuck_at, user_loops

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
    _progress_from: float | None = None  # monotonic time progress is watched from (None: not now)

    def watch_progress(self, on: bool) -> None:
        """Watch progress (the pumps run) or not (validation at the start and end): blocked loops always."""
        self._progress_from = time.monotonic() if on else None

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
        """Watch from a thread until cancelled; raises the watchdog's error when it stops the run."""
        loop = asyncio.get_running_loop()
        failed = loop.create_future()
        stop = threading.Event()
        beat = Heartbeat(loop, threading.get_ident())
        thread = threading.Thread(target=self._watch, args=(loop, failed, beat, stop), name="rl_core-watchdog",
                                  daemon=True)
        thread.start()
        try:
            await failed
        finally:
            stop.set()

    def _watch(self, loop, failed, beat: Heartbeat, stop: threading.Event) -> None:
        cfg = self.cfg
        tick = min(cfg.interval_s, cfg.block_timeout_s / 4, 0.5)
        last, t_last, t_check = self._progress(), time.monotonic(), time.monotonic()
        error: BaseException | None = None  # handed to the loop, not yet taken
        t_error = 0.0
        warned: set[int] = set()  # the controller's loop, warned of once per blocked stretch
        while not stop.wait(tick):
            now = time.monotonic()
            if error is not None:  # the loop did not take the error: it is blocked, end the process
                if not failed.done() and now - t_error >= max(2 * tick, 5.0):
                    hard_exit(f"{error}\n(the controller's event loop is blocked, so the run cannot stop through it: "
                              "exiting now; the newest step checkpoint is intact)")
                continue
            for hb, name in [(beat, "the controller's event loop"),
                             *((u.heartbeat, f"the event loop of {u.name}") for u in user_loops())]:
                blocked = hb.poke()
                if blocked < cfg.block_timeout_s:
                    warned.discard(id(hb))
                    continue
                where = stuck_at(hb.thread_id)
                text = self._blocked(name, blocked, where, hb is beat)
                # the controller's loop may be blocked by a slow step observer or reward function: a
                # warning now, the end of the run only at stall_timeout_s (action: abort)
                if hb is beat and (blocked < cfg.stall_timeout_s or cfg.action != "abort"):
                    if id(hb) not in warned:
                        warned.add(id(hb))
                        print(f"[watchdog] {text}", file=sys.stderr, flush=True)
                    continue
                error = BlockedLoopError(text)
                break
            since = self._progress_from
            if since is not None and t_last < since:  # progress is watched from now on
                last, t_last = self._progress(), since
            if error is None and since is not None and now - t_check >= cfg.interval_s:
                t_check, cur = now, self._progress()
                if cur != last:
                    last, t_last = cur, now
                elif now - t_last >= cfg.stall_timeout_s:
                    self.stalls += 1
                    text = self.report(now - t_last)
                    if cfg.action == "abort":  # a blocked controller loop is the cause to name
                        held = beat.poke()
                        error = BlockedLoopError(self._blocked("the controller's event loop", held,
                                                               stuck_at(beat.thread_id), True)) \
                            if held >= cfg.block_timeout_s else StallError(text)
                    else:
                        print(f"[watchdog] {text}", file=sys.stderr, flush=True)
                        t_last = now
            if error is not None:
                t_error = now
                try:
                    loop.call_soon_threadsafe(_fail, failed, error)
                except RuntimeError:  # the loop has closed: the run is over
                    return


    def _blocked(self, name: str, blocked: float, where: str | None, controller: bool) -> str:
        """What a blocked loop is told: where it is blocked and the fix."""
        cfg = self.cfg
        if controller:
            limit = (f"async_rl.watchdog.block_timeout_s={cfg.block_timeout_s:g}; the run stops at "
                     f"stall_timeout_s={cfg.stall_timeout_s:g}" if cfg.action == "abort" else
                     f"async_rl.watchdog.block_timeout_s={cfg.block_timeout_s:g}")
            fix = ("make it return quickly, or give it a deadline in a worker thread: async_rl.failure.env_timeout_s "
                   "runs environment scoring there")
        else:
            limit = f"async_rl.watchdog.block_timeout_s={cfg.block_timeout_s:g}"
            fix = ("use the async form of the call (`await asyncio.sleep(...)`, an async client), or run blocking "
                   "work in a thread: `await asyncio.to_thread(fn, ...)`")
        return (f"{name} ran no callback for {blocked:.0f}s ({limit}): it is blocked at "
                f"{where or 'a call outside your code'}. Code on an event loop must not block: everything on that "
                f"loop waits for it. Fix: {fix}.")


def _fail(failed: asyncio.Future, error: BaseException) -> None:
    if not failed.done():
        failed.set_exception(error)
