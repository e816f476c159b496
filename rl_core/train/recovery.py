"""In-job recovery of a multi-process trainer group, as the controller sees it: `RecoveringTrainer`.

Owns: a `TrainerBackend` that forwards every call to the current trainer and journals the calls
that change its state (`begin`, `train_microbatches`, `finish`, `abort`) since its *base* (the
newest step checkpoint, or what it was built from). When a call fails with `WorkerLostError`
(a worker rank died or hung), `restart(base, old, deadline)` gives a new group's trainer at the
base; the journal is replayed on it (the same chunks in the same order: the weights return to
the last finished step, bit for bit on a deterministic backend) and the failed call runs again.
The controller sees one slow call: no group is trained twice or lost, the weight version never
goes back. `trainer.recovery.max_restarts` bounds the replacements; `recovery/*` metrics.

Does not own: tearing down, starting and re-forming the group (`rl_core.launch.trainer_group`),
when checkpoints are taken (the controller). Read more: docs/cluster.md, "Failures".
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

from rl_core.train.spmd import WorkerLostError

MUTATING = ("begin", "train_microbatches", "finish", "abort")


class RecoveryFailed(WorkerLostError):
    """A lost trainer worker that could not be replaced (budget used up, deadline passed, restart failed)."""


@dataclasses.dataclass
class Recovery:
    """One replacement of the trainer group (logged, summed in metrics, listed in summary.json)."""

    lost: str  # the WorkerLostError: rank, host, pid and the command it was lost in
    during: str  # the trainer call that failed
    version: int  # the trainer's weight version when it failed
    restored_from: str  # the base the new group started from
    restored_version: int
    replayed_steps: list[int]  # RL steps (the versions they reached) trained again from the journal
    replayed_calls: int
    replayed_samples: int
    restart_s: float  # tear down, start, re-form, load the base
    replay_s: float
    seconds_lost: float  # from the failed call's start to its retry


class RecoveringTrainer:
    """A trainer backend that survives the loss of a worker rank (see the module doc).

    `restart(base, old, deadline)`: the launch layer's replacement of the group; returns a trainer
    at `base` (`old`: a list holding the failed trainer, to pop and tear down, so that no other
    reference keeps its memory; `deadline`: a `time.monotonic()` bound). `on_close`: run after `close`.
    `rebase(base)` after every step checkpoint: the journal restarts there."""

    def __init__(self, trainer: Any, restart: Callable[[Any, Any, float], Any], *, base: Any, base_version: int,
                 max_restarts: int, deadline_s: float, log: Callable[[str], None] = print):
        self._inner = trainer
        self._restart = restart
        self.base, self.base_version = base, base_version
        self.max_restarts, self.deadline_s = max_restarts, deadline_s
        self._log = log
        self._journal: list[tuple[str, tuple]] = []
        self._lock = threading.RLock()
        self.recoveries: list[Recovery] = []
        self._unreported: list[Recovery] = []  # not yet in a step's metrics
        self.on_close: Callable[[], None] | None = None

    def __getattr__(self, name: str) -> Any:  # version, optimizer_steps, reference_dir, device, ...
        if name.startswith("__") or name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    @property
    def trainer(self) -> Any:
        """The trainer of the current group."""
        return self._inner

    # ------------------------------------------------------------------ TrainerBackend

    def begin(self, loss) -> None:
        self._call("begin", loss)

    def train_microbatches(self, chunk) -> None:
        self._call("train_microbatches", chunk.to("cpu"))

    def finish(self, advance_version: bool = True) -> dict[str, float]:
        out = dict(self._call("finish", advance_version))
        if advance_version:
            out.update(self.take_metrics())
        return out

    def abort(self) -> None:
        self._call("abort")

    def logprobs(self, chunk, reference: bool = False):
        return self._call("logprobs", chunk, reference)

    def export_weights(self, on_device: bool = False):
        return self._call("export_weights", on_device=on_device)

    def save_pretrained(self, out_dir) -> None:
        self._call("save_pretrained", out_dir)

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise RuntimeError("a RecoveringTrainer restores through its restart function, not load_state_dict")

    def close(self) -> None:
        close = getattr(self._inner, "close", None)
        if close is not None:
            close()
        if self.on_close is not None:
            self.on_close()

    # ------------------------------------------------------------------ journal and recovery

    def rebase(self, base: Any, version: int) -> None:
        """The trainer's state is saved at `base` (a step checkpoint): replays start there now."""
        with self._lock:
            self.base, self.base_version = base, version
            self._journal.clear()

    def take_metrics(self) -> dict[str, float]:
        """`recovery/*` of the replacements since the last call (with the run's count so far)."""
        done, self._unreported = self._unreported, []
        return {"recovery/count_total": float(len(self.recoveries)),
                "recovery/seconds_lost": sum(r.seconds_lost for r in done),
                "recovery/replayed_steps": float(sum(len(r.replayed_steps) for r in done)),
                "recovery/replayed_samples": float(sum(r.replayed_samples for r in done))}

    def _call(self, name: str, *args, **kwargs) -> Any:
        with self._lock:
            while True:
                t0 = time.monotonic()
                try:
                    out = getattr(self._inner, name)(*args, **kwargs)
                except WorkerLostError as exc:
                    if isinstance(exc, RecoveryFailed):
                        raise
                    self._recover(exc.with_traceback(None), name, t0)  # the traceback's frames hold the old trainer
                    continue
                if name in MUTATING:
                    self._journal.append((name, args))
                return out

    def _recover(self, exc: WorkerLostError, during: str, t0: float) -> None:
        version = int(getattr(self._inner, "version", -1))
        while True:
            if len(self.recoveries) >= self.max_restarts:
                made = f"{len(self.recoveries)} replacement(s) already made" if self.recoveries else "none allowed"
                raise RecoveryFailed(f"{exc} The trainer group is not replaced again: trainer.recovery.max_restarts "
                                     f"= {self.max_restarts} ({made}). Raise it if workers are lost this often.") from exc
            self._log(f"[recovery] {exc.args[0] if exc.args else exc}")
            self._log(f"[recovery] replacing the trainer group ({len(self.recoveries) + 1}/{self.max_restarts}) "
                      f"during {during} at weight version {version}; restoring {self.base}")
            old, self._inner = [self._inner], None
            start = time.monotonic()
            try:
                self._inner = self._restart(self.base, old, start + self.deadline_s)
            except WorkerLostError as again:
                exc = again.with_traceback(None)
                self.recoveries.append(self._record(exc, during, version, [], 0, 0, start, start, t0))
                continue
            except Exception as err:  # noqa: BLE001 - the cause of the failed replacement, named once
                raise RecoveryFailed(f"{exc} Replacing the trainer group failed: {type(err).__name__}: {err}. "
                                     "Fix: rerun the same command; it resumes from the newest intact step "
                                     "checkpoint.") from err
            restarted = time.monotonic()
            if restarted > start + self.deadline_s:
                raise RecoveryFailed(f"{exc} Replacing the trainer group took {restarted - start:.0f}s, past "
                                     f"trainer.recovery.restart_deadline_s = {self.deadline_s:g}. Fix: raise it, or "
                                     "rerun the same command; it resumes from the newest intact step checkpoint.")
            try:
                steps, samples = self._replay()
            except WorkerLostError as again:  # lost another worker while replaying: count it and start over
                self.recoveries.append(self._record(exc, during, version, [], 0, 0, start, restarted, t0))
                exc = again.with_traceback(None)
                continue
            record = self._record(exc, during, version, steps, len(self._journal), samples, start, restarted, t0)
            self.recoveries.append(record)
            self._unreported.append(record)
            self._log(f"[recovery] trainer group replaced in {record.restart_s:.1f}s; replayed "
                      f"{record.replayed_calls} call(s) in {record.replay_s:.1f}s (RL steps "
                      f"{steps or 'none'}, {samples} samples) from version {self.base_version}; "
                      f"{record.seconds_lost:.1f}s lost; retrying {during}")
            return

    def _replay(self) -> tuple[list[int], int]:
        """Run the journal on the new trainer; returns the RL steps it finished and the samples it fed."""
        steps, samples = [], 0
        for name, args in self._journal:
            getattr(self._inner, name)(*args)
            if name == "train_microbatches":
                samples += args[0].num_samples
            elif name == "finish" and (args[0] if args else True):
                steps.append(int(self._inner.version))
        return steps, samples

    def _record(self, exc, during, version, steps, calls, samples, start, restarted, t0) -> Recovery:
        now = time.monotonic()
        return Recovery(lost=str(exc.args[0] if exc.args else exc), during=during, version=version,
                        restored_from=str(self.base), restored_version=self.base_version, replayed_steps=steps,
                        replayed_calls=calls, replayed_samples=samples, restart_s=restarted - start,
                        replay_s=now - restarted, seconds_lost=now - t0)
