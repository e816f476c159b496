"""NativeBackend: the `GenerationBackend` protocol over a `NativeEngine` in one worker thread.

Owns: the thread that drives the engine, and the hand-off between it and the asyncio event
loop of the controller. Every engine call happens on the worker thread: the loop side only
appends commands (generate, abort, update weights, invalidate, stop) to a deque guarded by
a `threading.Condition` and awaits an asyncio future; the worker drains the commands
between steps, loops `engine.step()` while there is work and resolves futures through the
loop's mailbox (`usercode.Mailbox`: one wakeup a step). Also: errors, cancellation,
streaming (`StreamDelta`) and lockstep stepping for reproducible runs.

Does not own: scheduling, sampling or stop rules (engine.py), or which weights to load
(the controller's refit calls `update_weights`).

Read more: docs/generation.md, "The backend's worker thread".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Mapping

import torch

from rl_core.generation.base import GenerationError, StreamDelta
from rl_core.generation.native.engine import NativeEngine
from rl_core.generation.native.options import EngineOptions
from rl_core.generation.native.model import load_safetensors_dir
from rl_core.types import GenerationRequest, GenerationResult, SamplingParams, group_requests
from rl_core.columns import GroupResults, logprob_array, logprob_rows, token_array, token_rows
from rl_core.usercode import mailbox

log = logging.getLogger(__name__)


@dataclass
class _Command:
    kind: str  # "generate" | "generate_group" | "abort" | "update_weights" | "invalidate" | "stop"
    payload: Any
    future: asyncio.Future | None
    loop: asyncio.AbstractEventLoop | None
    stream: asyncio.Queue | None = None  # generate: deltas go here (streaming requests only)
    sent: int = 0  # worker side: tokens already pushed to `stream`
    arrays: bool = False  # group calls: the result's token ids and logprobs as NumPy arrays
    group: "_Gathered | None" = None  # generate_group, worker side: the samples' results so far


class _Gathered:
    """Worker side: the results of one `generate_group` command, by sample index."""

    __slots__ = ("index", "results", "remaining")

    def __init__(self, n: int):
        self.index: dict[str, int] = {}
        self.results: list = [None] * n
        self.remaining = n


def _settle(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve a future on its loop's thread, unless its caller gave up on it."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def _quiesce(loop: asyncio.AbstractEventLoop, max_rounds: int = 10_000) -> None:
    """Yield until the event loop has no other ready callback (everything runnable has run).
    Loops without a visible ready queue get a fixed number of yields."""
    ready = getattr(loop, "_ready", None)
    for _ in range(max_rounds if ready is not None else 64):
        await asyncio.sleep(0)
        if ready is not None and not ready:
            return


class NativeBackend:
    """Async generation over a `NativeEngine` driven by one dedicated thread.

    `group_arrays`: the group calls (`generate_many`, `generate_group`) hand each result's
    token ids and logprobs over as 1-D NumPy arrays (what the controller packs by memory
    copies; the backends built from a recipe for training and evaluation set it); off, as
    `generate` and `generate_stream` always do, Python lists."""

    def __init__(self, engine: NativeEngine, name: str = "native", lockstep: bool = False,
                 group_arrays: bool = False):
        self.engine = engine
        self.name = name
        self.lockstep = lockstep
        self.group_arrays = group_arrays
        self._grant: tuple[int, asyncio.Future, asyncio.AbstractEventLoop] | None = None  # lockstep
        self._kick: asyncio.Event | None = None  # lockstep: set when a command is submitted
        self._driver: asyncio.Task | None = None  # lockstep: grants the worker its steps
        self._cond = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._waiters: dict[str, _Command] = {}  # worker thread only: request id -> its generate command
        self._streams: dict[str, _Command] = {}  # worker thread only: the streaming subset of _waiters
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._started_at = 0.0

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, options: EngineOptions | None = None) -> "NativeBackend":
        """A backend over `NativeEngine.from_pretrained(model_dir, options)`."""
        return cls(NativeEngine.from_pretrained(model_dir, options))

    # ------------------------------------------------------------------ protocol

    @property
    def weight_version(self) -> int:
        """The version of the weights applied in the engine (updated by the worker)."""
        return self.engine.version

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + completion) the engine takes: what a client's prompt is checked against."""
        return self.engine.max_seq_len

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: prompt token ids lie in [0, vocab_size)."""
        return self.engine.spec.vocab_size

    async def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("NativeBackend.start() was already called")
        self._started_at = time.monotonic()
        if self.lockstep:
            self._kick = asyncio.Event()
            self._driver = asyncio.create_task(self._drive(), name=f"{self.name}-lockstep")
        self._thread = threading.Thread(target=self._run_lockstep if self.lockstep else self._run,
                                        name=f"{self.name}-engine", daemon=True)
        self._thread.start()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        future = self._submit("generate", request)
        try:
            return await future
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):  # a dead worker has nothing to abort
                self._submit("abort", request.request_id, want_future=False)
            raise

    async def generate_many(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """`requests` submitted in order in one go (the commands a task per request would
        submit, in the same order), their results in that order: no task per request.
        Cancelled, or one request failed: every request without a result is aborted. With
        `group_arrays` the results' token ids and logprobs come as 1-D NumPy arrays
        (`columns.token_array`, `logprob_array`: the same values, converted once on the worker
        thread when the request finishes), so that the controller packs them by memory copies."""
        futures: list[asyncio.Future] = []
        try:
            for request in requests:
                futures.append(self._submit("generate", request, arrays=self.group_arrays))
            return list(await asyncio.gather(*futures))
        except BaseException:
            for request, future in zip(requests, futures):
                if not future.done() or future.cancelled():
                    with contextlib.suppress(Exception):  # a dead worker has nothing to abort
                        self._submit("abort", request.request_id, want_future=False)
            raise

    async def generate_group(self, key: str, prompt_ids: list[int], params: SamplingParams,
                             seeds: list[int]) -> GroupResults:
        """The group call (`protocols.GroupGenerationBackend`) as one command: the worker thread
        builds the per-sample requests the engine takes (`types.group_requests`: ids
        `f"{key}/{i}"`, a params copy per seed) and adds them in sample order, where
        `generate_many`'s commands would add the same requests in the same order; it gathers
        the results and settles one future with their columns (`GroupResults.of`; with
        `group_arrays` the group's token ids and its logprobs are one array each, every sample's
        a view of it: `columns.token_rows`, `logprob_rows`, two allocations per group instead
        of two per sample). The event loop builds no request, future or result per sample. A
        request the engine refuses fails the call (the group's requests added before it are
        aborted); cancelled, or failed: every sample without a result is aborted."""
        future = self._submit("generate_group", (key, prompt_ids, params, seeds), arrays=self.group_arrays)
        try:
            return await future
        except BaseException:
            if not future.done() or future.cancelled():
                with contextlib.suppress(Exception):  # a dead worker has nothing to abort
                    for i in range(len(seeds)):
                        self._submit("abort", f"{key}/{i}", want_future=False)
            raise

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta | GenerationResult]:
        """`StreamDelta`s as tokens are generated, then the final `GenerationResult`.
        Leaving the loop early (or cancelling the consumer) aborts the request."""
        queue: asyncio.Queue = asyncio.Queue()
        future = self._submit("generate", request, stream=queue)
        finished = False
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                try:
                    await asyncio.wait({getter, future}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not getter.done():
                        getter.cancel()
                if getter.done() and not getter.cancelled():
                    yield getter.result()
                    continue
                while not queue.empty():  # deltas pushed before the result was settled
                    yield queue.get_nowait()
                finished = True
                yield future.result()
                return
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    self._submit("abort", request.request_id, want_future=False)

    async def abort(self, request_id: str) -> None:
        await self._submit("abort", request_id)

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor] | str | Path,
                             kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Apply new weights between two steps; returns once they are live. A directory is
        read (safetensors) off the event loop first. Do not modify the tensors of a state
        dict until this returns. `kv_scales`: FP8 KV scales to apply (else the engine
        calibrates them, when its KV cache is FP8)."""
        if isinstance(weights, (str, Path)):
            weights = await asyncio.to_thread(load_safetensors_dir, weights)
        await self._submit("update_weights", (version, weights, kv_scales))

    async def invalidate_kv_cache(self) -> None:
        await self._submit("invalidate", None)

    def capacity(self) -> int:
        return self.engine.max_batch_size

    def metrics(self) -> dict[str, float]:
        """Counters since start; read without locking (each value is a consistent number,
        the set may straddle a step)."""
        s = self.engine.stats
        uptime = time.monotonic() - self._started_at if self._started_at else 0.0
        return {
            "steps": float(s.steps),
            "tokens_generated": float(s.tokens_generated),
            "tokens_fed": float(s.tokens_fed),
            "busy_s": s.busy_s,
            "uptime_s": uptime,
            "busy_fraction": s.busy_s / uptime if uptime > 0 else 0.0,
            "tokens_per_busy_s": s.tokens_generated / s.busy_s if s.busy_s > 0 else 0.0,
            "mean_batch_size": s.tokens_generated / s.steps if s.steps else 0.0,
            "batch_size": float(s.last_batch_size),
            "running": float(self.engine.num_running),
            "waiting": float(self.engine.num_waiting),
            "requests_added": float(s.requests_added),
            "requests_finished": float(s.requests_finished),
            "requests_aborted": float(s.requests_aborted),
            "weight_updates": float(s.weight_updates),
            "kv_invalidations": float(s.kv_invalidations),
            "weight_version": float(self.engine.version),
            "preemptions": float(s.preemptions),
            "kv_tokens": float(s.kv_tokens),
            "max_num_kv_tokens": float(self.engine.max_num_kv_tokens),
            "kv_calibrations": float(s.kv_calibrations),
            "static_decode_steps": float(s.static_decode_steps),
            "ahead_steps": float(s.ahead_steps),
        }

    def step_trace(self) -> list:
        """The most recent `StepRecord`s (start time, duration, rows, tokens), oldest first."""
        return list(self.engine.stats.trace)

    async def shutdown(self) -> None:
        """Abort pending requests (finish_reason "abort") and join the worker thread."""
        if self._thread is None:
            return
        with self._cond:
            self._stopping = True
            self._commands.append(_Command("stop", None, None, None))
            self._cond.notify()
        if self._kick is not None:
            self._kick.set()
        await asyncio.to_thread(self._thread.join)
        if self._driver is not None:  # the worker stopped (granted or not): the driver has nothing to wait for
            self._driver.cancel()
            await asyncio.gather(self._driver, return_exceptions=True)

    # ------------------------------------------------------------------ loop side

    def _submit(self, kind: str, payload: Any, want_future: bool = True,
                stream: asyncio.Queue | None = None, arrays: bool = False) -> asyncio.Future | None:
        if self._thread is None:
            raise RuntimeError(f"{type(self).__name__}.start() must be awaited before {kind}")
        loop = asyncio.get_running_loop() if want_future else None
        future = loop.create_future() if loop is not None else None
        with self._cond:  # the worker sets _dead and drains under this lock: nothing is lost
            if self._dead is not None:
                raise GenerationError(f"the {self.name} backend's worker died: {self._dead!r}") from self._dead
            if self._stopping and want_future:
                raise RuntimeError(f"the {self.name} backend is shut down")
            self._commands.append(_Command(kind, payload, future, loop, stream, arrays=arrays))
            self._cond.notify()
        if self._kick is not None:
            self._kick.set()
        return future

    async def _drive(self) -> None:
        """Lockstep: settle the loop, then grant the worker one step with the commands so far."""
        loop = asyncio.get_running_loop()
        has_work = False
        while True:
            if not has_work and not self._commands:
                await self._kick.wait()
            self._kick.clear()
            await _quiesce(loop)
            granted = loop.create_future()
            with self._cond:
                if self._dead is not None:
                    return
                self._grant = (len(self._commands), granted, loop)
                self._cond.notify()
            has_work, stop = await granted
            if stop:
                return

    # ------------------------------------------------------------------ worker side

    def _resolve(self, command: _Command, result: Any = None, error: BaseException | None = None) -> None:
        if command.future is not None:
            try:
                mailbox(command.loop).post(_settle, command.future, result, error)  # one wakeup a step's results
            except RuntimeError:  # the caller's event loop is closed: nobody is waiting
                pass

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._commands and not self.engine.has_work():
                        self._cond.wait()
                    commands = list(self._commands)
                    self._commands.clear()
                if self._serve(commands):
                    return
        except BaseException as exc:  # a bug in the worker itself: fail everyone, loudly
            log.exception("the %s backend's worker died", self.name)
            self._die(exc)

    def _serve(self, commands: list[_Command]) -> bool:
        """Execute `commands`, then one engine step if there is work; True once told to stop
        (what is still pending is aborted)."""
        stop = False
        for command in commands:
            stop |= command.kind == "stop"
            self._execute(command)
        if stop:
            for result in self.engine.abort_all():
                self._finish(result)
            return True
        if self.engine.has_work():
            self._step()
        return False

    def _run_lockstep(self) -> None:
        """Lockstep worker: per grant, execute exactly the granted commands, then one step."""
        granted = None
        try:
            while True:
                with self._cond:
                    while self._grant is None and not self._stopping:
                        self._cond.wait()
                    if self._grant is not None:
                        n, granted, loop = self._grant
                        self._grant = None
                    else:  # shutting down, maybe with no driver left (its loop is closing): take all
                        n, granted, loop = len(self._commands), None, None
                    commands = [self._commands.popleft() for _ in range(min(n, len(self._commands)))]
                stopped = self._serve(commands)
                if granted is not None:
                    with contextlib.suppress(RuntimeError):  # the driver's loop is closed
                        loop.call_soon_threadsafe(_settle, granted, (not stopped and self.engine.has_work(), stopped))
                    granted = None
                if stopped:
                    return
        except BaseException as exc:  # a bug in the worker itself: fail everyone, loudly
            log.exception("the %s backend's worker died", self.name)
            self._die(exc)
            if granted is not None:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_settle, granted, (False, True))

    def _die(self, exc: BaseException) -> None:
        error = GenerationError(f"the {self.name} backend's worker died: {exc!r}")
        error.__cause__ = exc
        with self._cond:
            self._dead = exc
            pending = list(self._commands)
            self._commands.clear()
        for command in list(self._waiters.values()) + pending:
            self._resolve(command, error=error)
        self._waiters.clear()
        self._streams.clear()

    def _execute(self, command: _Command) -> None:
        try:
            if command.kind == "generate_group":
                self._add_group(command)
                return
            if command.kind == "generate":
                self.engine.add_request(command.payload)
                self._waiters[command.payload.request_id] = command
                if command.stream is not None:
                    self._streams[command.payload.request_id] = command
                return
            if command.kind == "abort":
                result = self.engine.abort(command.payload)
                if result is not None:
                    self._finish(result)
            elif command.kind == "update_weights":
                version, weights, kv_scales = command.payload
                self.engine.update_weights(version, weights, kv_scales=kv_scales)
            elif command.kind == "invalidate":
                self.engine.invalidate_kv_cache()
            self._resolve(command)
        except Exception as exc:  # the caller's request or weights were refused
            self._resolve(command, error=exc)

    def _add_group(self, command: _Command) -> None:
        """Add a `generate_group` command's requests in sample order; if the engine refuses
        one, abort those added before it (their results are dropped) and raise."""
        key, prompt_ids, params, seeds = command.payload
        requests = group_requests(key, prompt_ids, params, seeds)
        gathered = command.group = _Gathered(len(requests))
        added: list[str] = []
        try:
            for i, request in enumerate(requests):
                self.engine.add_request(request)
                added.append(request.request_id)
                gathered.index[request.request_id] = i
                self._waiters[request.request_id] = command
        except Exception:
            for request_id in added:
                self._waiters.pop(request_id, None)
                self.engine.abort(request_id)
            raise

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as exc:
            log.exception("the %s engine failed in a step; its %d requests fail with it", self.name, len(self._waiters))
            error = GenerationError(f"the {self.name} engine failed in a step: {exc!r}")
            error.__cause__ = exc
            self.engine.abort_all()
            for command in self._waiters.values():
                self._resolve(command, error=error)
            self._waiters.clear()
            self._streams.clear()
            return
        for result in finished:
            self._finish(result)
        for request_id, command in self._streams.items():
            progress = self.engine.progress(request_id)
            if progress is not None:
                self._push(command, *progress)

    def _push(self, command: _Command, tokens: list[int], logprobs: list[float], top: list | None) -> None:
        """Send a streaming request the tokens it has not seen yet."""
        if len(tokens) <= command.sent:
            return
        start, command.sent = command.sent, len(tokens)
        delta = StreamDelta(tokens[start:], logprobs[start:], None if top is None else top[start:])
        try:
            mailbox(command.loop).post(command.stream.put_nowait, delta)  # in order with the result
        except RuntimeError:  # the caller's event loop is closed
            pass

    def _finish(self, result: GenerationResult) -> None:
        command = self._waiters.pop(result.request_id, None)
        self._streams.pop(result.request_id, None)
        if command is not None:
            if command.stream is not None:
                self._push(command, result.token_ids, result.logprobs, result.top_logprobs)
            gathered = command.group
            if gathered is None:
                if command.arrays:
                    result.token_ids = token_array(result.token_ids)
                    result.logprobs = logprob_array(result.logprobs)
                self._resolve(command, result)
                return
            gathered.results[gathered.index[result.request_id]] = result
            gathered.remaining -= 1
            if gathered.remaining == 0:
                columns = GroupResults.of(gathered.results)
                if command.arrays:  # the group's completions and logprobs: one array each, a view per sample
                    columns.token_ids = token_rows(columns.token_ids)
                    columns.logprobs = logprob_rows(columns.logprobs)
                self._resolve(command, columns)
