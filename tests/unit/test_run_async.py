"""`run_async`: the Python API's event loop, also where one is already running (a notebook's
kernel; tests/integration/test_notebook.py runs the real one)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from rl_core.launch.train import run_async


async def _work(x: int):
    await asyncio.sleep(0.01)
    return x, threading.current_thread().name, asyncio.get_running_loop()


def test_without_a_running_loop_it_is_asyncio_run():
    x, thread, _ = run_async(_work(1))
    assert x == 1 and thread == threading.main_thread().name


def test_inside_a_running_loop_the_run_gets_a_loop_and_thread_of_its_own():
    async def cell():  # what a notebook cell is: code running on the kernel's loop
        coro = _work(0)
        with pytest.raises(RuntimeError, match="cannot be called from a running event loop"):
            asyncio.run(coro)  # the failure the API had
        coro.close()
        return run_async(_work(2)), asyncio.get_running_loop()

    (x, thread, loop), outer = asyncio.run(cell())
    assert x == 2 and thread == "rl_core-event-loop" and loop is not outer


def test_an_error_of_the_run_is_raised_to_the_caller():
    async def fail():
        raise ValueError("bad step")

    async def cell():
        run_async(fail())

    with pytest.raises(ValueError, match="bad step"):
        asyncio.run(cell())


def test_an_interrupt_cancels_the_run_and_waits_for_it():
    ended = threading.Event()

    async def long():
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    async def cell():
        run_async(long())

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)  # the notebook's stop button: SIGINT -> KeyboardInterrupt
    t0 = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(cell())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert ended.is_set() and time.monotonic() - t0 < 30  # cancelled and wound down before the raise
