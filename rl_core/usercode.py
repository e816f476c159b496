"""Where user code runs so that it cannot hang the run, and how a blocked thread or loop is named.

Owns: `DaemonPool`, an executor of daemon threads (a call stuck past its deadline never keeps
the process from exiting, and `abandon` lets a fresh thread take its place); `UserLoop`, an
event loop on a daemon thread of its own for user coroutines (agents), so an agent that blocks
stops its own loop, never the controller's; `run_on`, a coroutine run on another thread's loop
(`Mailbox`: calls posted to a loop from other threads, one wakeup a batch); `Heartbeat`, how
long a loop has run no callback; `stuck_at`, the innermost frame of the user's code on a
thread's stack; the hooks run before the watchdog ends a process whose loop is blocked
(`on_hard_exit`, `hard_exit`).

Does not own: deadlines and retries (rl_core.resilience), deciding when a loop is blocked too
long (rl_core.controller.watchdog). Guide: docs/controller.md, "Resilience".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import linecache
import os
import queue
import sys
import threading
import time
import weakref
from typing import Any, Callable

from rl_core.errors import UserError, is_user_file


class BlockedLoopError(UserError, RuntimeError):
    """User code kept an event loop from running for longer than the watchdog allows; the message
    names the function, its file and line."""


def stuck_at(thread_id: int | None) -> str | None:
    """Where the user's code is on thread `thread_id`'s stack now: `module.function (file:line:
    `source`)` of the innermost frame outside rl_core and the Python installation; None when no
    frame is the user's (or the thread is gone)."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            return _describe(frame)
        frame = frame.f_back
    return None


def awaiting_at(coro) -> str | None:
    """Where the user's code in the suspended coroutine `coro` awaits (its innermost user frame
    along the chain of awaited coroutines), as `stuck_at` writes it; None when none is the user's."""
    found = None
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None and is_user_file(frame.f_code.co_filename):
            found = _describe(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return found


def _describe(frame) -> str:
    code = frame.f_code
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_globals.get('__name__', '?')}.{code.co_name} ({code.co_filename}:{frame.f_lineno}: `{line}`)"


class DaemonPool(concurrent.futures.Executor):
    """Up to `max_workers` daemon threads running submitted calls (`loop.run_in_executor` takes
    it). Unlike `ThreadPoolExecutor` its threads are not joined at interpreter exit, so a call
    that never returns cannot keep the process alive; `abandon(future)` gives up on a running
    call: its thread leaves the pool (ending when the call returns, if ever) and a new one may start."""

    def __init__(self, max_workers: int, name: str):
        self.max_workers, self.name = max_workers, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: set[int] = set()  # idents of the pool's threads (abandoned ones removed)
        self._idle = 0
        self._running: dict[concurrent.futures.Future, int] = {}  # future -> thread running it
        self._count = 0

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args, kwargs))
        with self._lock:
            if self._idle < self._queue.qsize() and len(self._workers) < self.max_workers:
                self._count += 1
                self._idle += 1
                thread = threading.Thread(target=self._work, name=f"{self.name}-{self._count}", daemon=True)
                thread.start()
                self._workers.add(thread.ident)
        return future

    def _work(self) -> None:
        me = threading.get_ident()
        while True:
            future, fn, args, kwargs = self._queue.get()
            with self._lock:
                self._idle -= 1
                run = future.set_running_or_notify_cancel()  # False: cancelled while queued (its deadline passed)
                if run:
                    self._running[future] = me
            if run:
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                    future.set_exception(exc)
            with self._lock:
                self._running.pop(future, None)
                if me not in self._workers:  # abandoned while the call ran: a new thread took its place
                    return
                self._idle += 1

    def thread_of(self, future: concurrent.futures.Future) -> int | None:
        """The ident of the thread running `future`'s call, None when it is not running."""
        return self._running.get(future)

    def abandon(self, future: concurrent.futures.Future) -> None:
        """Give up on `future`'s call (past its deadline): its thread no longer counts."""
        with self._lock:
            self._workers.discard(self._running.get(future, -1))


_LOOPS: weakref.WeakSet = weakref.WeakSet()  # the live UserLoops (the watchdog watches each)


class UserLoop:
    """An event loop on a daemon thread of its own, named `name` (e.g. `agent my_agents:agent`),
    for user coroutines: `await user_loop.run(coro)` from any other loop. A coroutine that blocks
    stops only this loop (the watchdog names it); cancelling the caller cancels the coroutine."""

    def __init__(self, name: str):
        self.name = name
        self.loop = asyncio.new_event_loop()
        self.heartbeat = Heartbeat(self.loop)
        self._thread = threading.Thread(target=self._main, name="rl_core-user-loop", daemon=True)
        self._thread.start()
        self.heartbeat.thread_id = self._thread.ident
        _LOOPS.add(self)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    async def run(self, coro):
        """Run `coro` on this loop and return its result here (`run_on`). Cancelled (a deadline, a
        stale group), it is cancelled there; the CancelledError carries `stuck_at`: where it awaited."""
        def where(exc: asyncio.CancelledError) -> None:  # before it is cancelled there
            exc.stuck_at = awaiting_at(coro)  # read by resilience.with_deadline

        return await run_on(self.loop, coro, where)

    async def run_within(self, coro, timeout_s: float):
        """`run`, but give up after `timeout_s` (a loop blocked by user code never answers)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except asyncio.TimeoutError:
            return None

    def close(self) -> None:
        """Stop the loop (at once when it is idle; a loop blocked in user code stays with its daemon thread)."""
        _LOOPS.discard(self)
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)


class Mailbox:
    """Calls posted to event loop `loop` from any thread, run there in the order posted. A post
    wakes the loop (`call_soon_threadsafe`: a write to its self-pipe) only when no earlier post
    is still waiting: a burst of posts (the replies of one engine step, the next calls of many
    agents) costs one wakeup and one loop callback, not one each. Get a loop's with `mailbox`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # not kept alive by its mailbox (`mailbox`'s weak table)
        self._lock = threading.Lock()
        self._calls: list[tuple[Callable, tuple]] = []
        self._scheduled = False

    def post(self, fn: Callable, *args: Any) -> None:
        """Run `fn(*args)` on the loop soon (RuntimeError when the loop is closed)."""
        with self._lock:
            self._calls.append((fn, args))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            loop = self._loop()
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            with self._lock:
                self._scheduled = False
                self._calls.clear()
            raise

    def _drain(self) -> None:
        with self._lock:
            calls, self._calls, self._scheduled = self._calls, [], False
        for fn, args in calls:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - one failed call must not drop the others
                asyncio.get_running_loop().call_exception_handler(
                    {"message": f"rl_core mailbox call {fn!r} failed", "exception": exc})


_MAILBOXES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox]" = weakref.WeakKeyDictionary()
_MAILBOXES_LOCK = threading.Lock()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The `Mailbox` of `loop` (one per loop, made on first use)."""
    box = _MAILBOXES.get(loop)
    if box is None:
        with _MAILBOXES_LOCK:
            box = _MAILBOXES.get(loop)
            if box is None:
                box = _MAILBOXES[loop] = Mailbox(loop)
    return box


async def run_on(loop: asyncio.AbstractEventLoop, coro, on_cancel: Callable[[BaseException], Any] | None = None):
    """Run `coro` as a task on `loop` (another thread's event loop) and return its result (or
    raise its error) here; cancelling the caller cancels the task there (after
    `on_cancel(the CancelledError)`). Both hand-offs go through the loops' mailboxes (`Mailbox`).
    On the caller's own loop, `coro` is awaited."""
    here = asyncio.get_running_loop()
    if loop is here:
        return await coro
    call = _RemoteCall(coro, here.create_future(), mailbox(here))
    mailbox(loop).post(call.start)
    try:
        return await call.waiter
    except asyncio.CancelledError as exc:
        if on_cancel is not None:
            on_cancel(exc)
        if call.outcome is None:  # not finished there: cancel it there
            with contextlib.suppress(RuntimeError):  # that loop is closed: nothing runs there
                mailbox(loop).post(call.cancel)
        raise


class _RemoteCall:
    """`run_on`'s call: started, cancelled and finished on the target loop, settled on the caller's."""

    __slots__ = ("coro", "waiter", "back", "task", "cancelled", "outcome")

    def __init__(self, coro, waiter: asyncio.Future, back: Mailbox):
        self.coro, self.waiter, self.back = coro, waiter, back
        self.task: asyncio.Task | None = None
        self.cancelled = False
        self.outcome: tuple | None = None  # (cancelled, error, result), set on the target loop

    def start(self) -> None:
        if self.cancelled:  # cancelled before it started
            self.coro.close()
            return
        self.task = asyncio.ensure_future(self.coro)
        self.task.add_done_callback(self._done)

    def cancel(self) -> None:
        self.cancelled = True
        if self.task is not None:
            self.task.cancel()

    def _done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            self.outcome = (True, None, None)
        else:
            self.outcome = (False, task.exception(), None if task.exception() else task.result())
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
            self.back.post(self._settle)

    def _settle(self) -> None:
        if self.waiter.done():
            return
        cancelled, error, result = self.outcome
        if cancelled:
            self.waiter.cancel()
        elif error is not None:
            self.waiter.set_exception(error)
        else:
            self.waiter.set_result(result)


def user_loops() -> list[UserLoop]:
    """The live user loops of this process."""
    return list(_LOOPS)


class Heartbeat:
    """How long an event loop has gone without running a callback: `poke()` (from another thread)
    posts a beat to the loop unless one is pending, and returns for how long the pending one has
    waited (0.0 when the loop ran the last)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread_id: int | None = None):
        self.loop, self.thread_id = loop, thread_id
        self._posted: float | None = None

    def _beat(self) -> None:
        self._posted = None

    def poke(self) -> float:
        posted = self._posted
        now = time.monotonic()
        if posted is not None:
            return now - posted
        self._posted = now
        try:
            self.loop.call_soon_threadsafe(self._beat)
        except RuntimeError:  # the loop is closed
            self._posted = None
        return 0.0


_HARD_EXIT_HOOKS: list[Callable[[], Any]] = []


def on_hard_exit(hook: Callable[[], Any]) -> Callable[[], None]:
    """Run `hook` before `hard_exit` ends the process (e.g. stop a service rl_core started);
    returns the function that removes it."""
    _HARD_EXIT_HOOKS.append(hook)
    return lambda: _HARD_EXIT_HOOKS.remove(hook) if hook in _HARD_EXIT_HOOKS else None


def hard_exit(message: str, code: int = 2) -> None:
    """End the process now: the event loop is blocked, so the run cannot stop through it. Prints
    `message`, runs the `on_hard_exit` hooks, and exits with `code` (step checkpoints are atomic:
    the newest complete one stays intact)."""
    print(f"rl-core: {message}", file=sys.stderr, flush=True)
    for hook in list(_HARD_EXIT_HOOKS):
        try:
            hook()
        except Exception as exc:  # noqa: BLE001 - the process ends anyway
            print(f"rl-core: while exiting: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)
