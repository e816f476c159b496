"""Rank-0 driver and following worker ranks: a multi-process trainer behind the one-process
`TrainerBackend` protocol.

Owns: `CommandChannel`. Rank 0 (the controller) publishes each public call as a *command*
`(sequence number, name, arguments)` on the process group's store and runs its SPMD body
(`_spmd_<name>`); every other rank (`CommandChannel.serve`) runs the same bodies in order.
Workers post `ok` or their traceback (`dead/<rank>` when they leave), and a heartbeat a second;
rank 0 raises the first worker error with its rank, or `WorkerLostError` naming a worker whose
heartbeat is `heartbeat_timeout_s` old (a watchdog kills a lost worker, of this host or through
the launcher's `kill_far`, which ends a collective that hangs on it; it ends rank 0 only without
`recoverable` or if that fails). Arguments travel pickle-free (`rl_core.train.wire`); the
store, not a broadcast, because a worker may wait a whole generation.

Does not own: what the commands do (the trainers), the process group's set-up
(`rl_core.distributed`). Read more: docs/distributed-training.md."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

from rl_core.train import wire

COMMAND_PREFIX = "rl_core/trainer/"
INIT, SHUTDOWN = "__init__", "__shutdown__"
HEARTBEAT_S = 1.0  # a worker's heartbeat period
HANG_GRACE_S = 10.0  # the watchdog ends rank 0 this long after a lost worker, if its command still runs
FAULT_ENV = "RL_CORE_TRAINER_FAULT"  # fault injection on a worker: "<command>:<version>:<SIGNAL>" (tests, drills)
_SHARED: tuple[Any, "CommandChannel"] | None = None


class WorkerError(RuntimeError):
    """A worker rank of a distributed trainer failed while running a command."""


class WorkerLostError(WorkerError):
    """A worker rank stopped answering: no heartbeat for `heartbeat_timeout_s` (killed, or its node lost)."""


class CommandChannel:
    """Commands from rank 0 to the other ranks of the trainer group (see the module doc).

    Use `CommandChannel.shared()`: one channel per process and process group, so that a
    second trainer built on rank 0 (e.g. to restore a checkpoint) continues the command
    sequence; on the workers it replaces the first trainer."""

    @classmethod
    def shared(cls, timeout_s: float = 1800.0, heartbeat_timeout_s: float = 30.0) -> "CommandChannel":
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        global _SHARED
        group = distributed_c10d._get_default_group()
        if _SHARED is None or _SHARED[0] is not group:
            _SHARED = (group, cls(dist.get_rank(), dist.get_world_size(), timeout_s=timeout_s,
                                  heartbeat_timeout_s=heartbeat_timeout_s))
        _SHARED[1].timeout_s = timeout_s
        _SHARED[1].heartbeat_timeout_s = heartbeat_timeout_s
        return _SHARED[1]

    def __init__(self, rank: int, world_size: int, store=None, timeout_s: float = 1800.0,
                 heartbeat_timeout_s: float = 30.0):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._seq = 0
        self._dead: set[int] = set()
        self._lost = ""  # the message of the first WorkerLostError
        self._lock = threading.RLock()
        # rank 0: per worker, its last heartbeat count and when (monotonic) it last changed
        self._beats: dict[int, tuple[int, float]] = {}
        self._running_since: float | None = None  # a command is running on rank 0 since then
        self._watchdog: threading.Thread | None = None
        self._closed = False  # rank 0 left this group (`abandon`): its watchdog stops
        # rank 0 with trainer.recovery: a lost worker is killed rather than rank 0 itself
        self.recoverable = False
        # rank 0: the launcher's kill of workers on other nodes ({rank: whereabouts} -> ranks not reached)
        self.kill_far: Callable[[dict[int, dict]], list[int]] | None = None
        self.store = None
        if world_size > 1:
            import torch.distributed as dist
            from torch.distributed import distributed_c10d

            base = store if store is not None else distributed_c10d._get_default_store()
            self.store = dist.PrefixStore(COMMAND_PREFIX, base)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ driver side

    def publish(self, name: str, args: tuple = (), kwargs: dict | None = None) -> int:
        """Rank 0: post a command for the workers; returns its sequence number."""
        assert self.is_driver, "only rank 0 publishes commands"
        seq = self._seq
        self._seq += 1
        if self.store is not None:
            if self._lost:  # the same message again: the one that names the lost worker reaches the user
                raise WorkerLostError(self._lost)
            if self._dead:
                raise WorkerError(f"trainer worker rank(s) {sorted(self._dead)} failed earlier; the trainer group "
                                  "is unusable (see the first error above)")
            self.store.set(f"cmd/{seq}", wire.dumps([name, tuple(args), dict(kwargs or {})]))
        return seq

    # ------------------------------------------------------------------ heartbeats

    def lost_workers(self) -> list[int]:
        """Rank 0: the workers whose heartbeat has not moved for `heartbeat_timeout_s` (one that
        has not beaten yet is still starting: collective_timeout_s bounds that)."""
        now, lost = time.monotonic(), []
        for r in range(1, self.world_size):
            count = int(self.store.add(f"beat/{r}", 0))
            if count == 0:
                continue
            last = self._beats.get(r)
            if last is None or count != last[0]:
                self._beats[r] = (count, now)
            elif now - last[1] > self.heartbeat_timeout_s:
                lost.append(r)
        return lost

    def describe_lost(self, ranks: list[int], during: str) -> str:
        who = []
        for r in ranks:
            info = self.whereabouts(r)
            who.append(f"rank {r} (host {info.get('host', '?')}, pid {info.get('pid', '?')})")
        return (f"trainer worker {', '.join(who)} stopped answering {during}: no heartbeat for "
                f"{self.heartbeat_timeout_s:.0f}s (trainer.worker_heartbeat_timeout_s); it was killed or its node was "
                "lost. Fix: rerun the same command; it resumes from the newest intact step checkpoint.")

    def _watch(self) -> None:
        """Rank 0's watchdog: a collective that waits on a lost worker may block until
        collective_timeout_s. With `recoverable`, kill the lost workers of this host (their sockets
        close, the collective fails, the trainer group is replaced); if rank 0's command still runs
        HANG_GRACE_S later, or without `recoverable`, end rank 0 naming the worker (step checkpoints
        are atomic)."""
        killed_at: float | None = None
        while not self._closed:
            time.sleep(HEARTBEAT_S)
            since = self._running_since
            if since is None or self.store is None:
                killed_at = None
                continue
            try:
                lost = self.lost_workers()
            except Exception:  # noqa: BLE001 - the store itself is gone: the command fails on its own
                continue
            if not lost or time.monotonic() - since <= self.heartbeat_timeout_s:
                continue
            if self.recoverable and killed_at is None:
                self.kill_workers(lost)
                killed_at = time.monotonic()
                continue
            if time.monotonic() - (since + self.heartbeat_timeout_s if killed_at is None else killed_at) > HANG_GRACE_S:
                sys.stderr.write(f"[trainer] {WorkerLostError.__name__}: "
                                 f"{self.describe_lost(lost, 'while a collective waited for it')}\n")
                sys.stderr.flush()
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)  # not an exception: the main thread is inside C++

    def whereabouts(self, rank: int) -> dict:
        """Rank 0: the host and pid worker `rank` posted when it started serving ({} if unknown)."""
        try:
            return json.loads(self.store.get(f"who/{rank}")) if self.store.check([f"who/{rank}"]) else {}
        except (ValueError, RuntimeError):
            return {}

    def kill_workers(self, ranks: list[int]) -> list[int]:
        """Rank 0: SIGKILL the given workers (lost ones, or survivors of a group being replaced): on
        this host directly, on other nodes through `kill_far`; returns the ranks it could not reach."""
        far: dict[int, dict] = {}
        for r in ranks:
            info = self.whereabouts(r)
            if info.get("host") != socket.gethostname() or not info.get("pid"):
                far[r] = info
                continue
            try:
                os.kill(int(info["pid"]), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if far and self.kill_far is not None:
            return sorted(self.kill_far(far))
        return sorted(far)

    def abandon(self) -> None:
        """Rank 0: leave this group without releasing its workers (it is being replaced)."""
        global _SHARED
        self._closed = True
        self._dead.update(range(1, self.world_size))
        if _SHARED is not None and _SHARED[1] is self:
            _SHARED = None

    def _beat_forever(self) -> None:
        self.store.set(f"who/{self.rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                       "node": os.environ.get("SLURMD_NODENAME")}))
        while True:
            try:
                self.store.add(f"beat/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - rank 0 is gone; the serve loop fails on its own
                return
            time.sleep(HEARTBEAT_S)

    def complete(self, seq: int) -> None:
        """Rank 0: wait until every worker finished command `seq`; raise the first worker error,
        or `WorkerLostError` for a worker whose heartbeat stopped."""
        if self.store is None:
            return
        pending = [r for r in range(1, self.world_size) if r not in self._dead]
        deadline = time.monotonic() + self.timeout_s
        checked = time.monotonic()  # heartbeats are read once a HEARTBEAT_S while workers are busy
        errors: list[str] = []
        delay = 1e-4
        while pending:
            still = []
            for r in pending:
                if self.store.check([f"done/{seq}/{r}"]):
                    status = self.store.get(f"done/{seq}/{r}")
                    if status != b"ok":
                        errors.append(f"rank {r}:\n{status.decode(errors='replace')}")
                        self._dead.add(r)
                elif self.store.check([f"dead/{r}"]):
                    self._dead.add(r)
                    errors.append(f"rank {r} left before command {seq}:\n"
                                  f"{self.store.get(f'dead/{r}').decode(errors='replace')}")
                else:
                    still.append(r)
            pending = still
            if pending:
                lost = []
                if time.monotonic() - checked > HEARTBEAT_S:
                    checked = time.monotonic()
                    lost = [r for r in self.lost_workers() if r in pending]
                if lost:
                    self._dead.update(lost)
                    self._lost = self.describe_lost(lost, f"during command {seq}")
                    raise WorkerLostError(self._lost)
                if time.monotonic() > deadline:
                    raise WorkerError(f"trainer worker rank(s) {pending} did not finish command {seq} within "
                                      f"{self.timeout_s:.0f}s (trainer.collective_timeout_s)")
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
        if seq >= 2:
            self._forget(seq - 2)
        if errors:
            raise WorkerError("a trainer worker failed:\n" + "\n".join(errors))

    def call(self, target: Any, name: str, *args, **kwargs) -> Any:
        """Rank 0: run command `name` on every rank; returns rank 0's result. Calls from several
        threads (train pump worker thread, event loop) are serialised: one command at a time."""
        with self._lock:
            seq = self.publish(name, args, kwargs)
            if self._watchdog is None and self.store is not None:
                self._watchdog = threading.Thread(target=self._watch, name="trainer-watchdog", daemon=True)
                self._watchdog.start()
            self._running_since = time.monotonic()
            try:
                try:
                    result = getattr(target, f"_spmd_{name}")(*args, **kwargs)
                except BaseException as exc:
                    try:
                        self.complete(seq)
                    except WorkerLostError as lost:  # why rank 0's collective failed: name the worker
                        raise lost from exc
                    except WorkerError:
                        pass  # rank 0's own error is the one to report
                    raise
                self.complete(seq)
                return result
            finally:
                self._running_since = None

    def shutdown(self) -> None:
        """Rank 0: release the workers from `serve` (each returns). With a worker gone there is
        no group left to release: the error that said so is the one to report."""
        if self.store is not None and self.is_driver and not self._dead:
            self.complete(self.publish(SHUTDOWN))

    def _forget(self, seq: int) -> None:
        for key in [f"cmd/{seq}"] + [f"done/{seq}/{r}" for r in range(1, self.world_size)]:
            try:
                self.store.delete_key(key)
            except Exception:  # older stores without delete: keys are small, leave them
                return

    # ------------------------------------------------------------------ worker side

    def _next_command(self, seq: int) -> tuple[str, tuple, dict]:
        key = f"cmd/{seq}"
        delay = 1e-4
        while not self.store.check([key]):
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        message = wire.loads(self.store.get(key))
        if (not isinstance(message, list) or len(message) != 3 or not isinstance(message[0], str)
                or not isinstance(message[1], tuple) or not isinstance(message[2], dict)):
            raise wire.WireError(f"command {seq} is not [name, args, kwargs]")
        name, args, kwargs = message
        return name, args, kwargs

    def serve(self, factory: Callable[..., Any]) -> None:
        """Worker ranks: run commands until the driver shuts the group down.

        The first command is `__init__` with the trainer's constructor arguments: the worker
        builds its trainer with `factory(**kwargs)` (a collective, like every command)."""
        assert not self.is_driver and self.store is not None
        threading.Thread(target=self._beat_forever, name="trainer-heartbeat", daemon=True).start()
        target = None
        while True:
            seq = self._seq
            self._seq += 1
            try:
                name, args, kwargs = self._next_command(seq)  # a message that does not decode fails here
                if name == SHUTDOWN:
                    self.store.set(f"done/{seq}/{self.rank}", b"ok")
                    return
                if name == INIT:
                    target = factory(**kwargs)
                else:
                    if target is None:
                        raise RuntimeError(f"command {name!r} before the trainer was built")
                    inject_fault(name, getattr(target, "version", None))
                    getattr(target, f"_spmd_{name}")(*args, **kwargs)
            except BaseException:
                tb = traceback.format_exc()
                self.store.set(f"done/{seq}/{self.rank}", tb.encode())
                self.store.set(f"dead/{self.rank}", tb.encode())
                raise
            self.store.set(f"done/{seq}/{self.rank}", b"ok")


def inject_fault(command: str, version: int | None) -> None:
    """A drill of fault (b) of docs/cluster.md: `RL_CORE_TRAINER_FAULT=<command>:<version>:<SIGNAL>` in a
    worker's environment sends it SIGNAL (KILL: dies; STOP: hangs) as it starts `command` at weight
    version `version`, once; a replacement worker is started without it."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    want, at, sig = spec.split(":")
    if command == want and version == int(at):
        del os.environ[FAULT_ENV]
        sys.stderr.write(f"[trainer] {FAULT_ENV}: SIG{sig} to this worker (pid {os.getpid()}) at {command}, "
                         f"version {version}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
