"""A trainer worker killed outright (fault (b) of docs/cluster.md, on one machine): rank 0's
command channel and a real worker process on a TCP store; the worker is SIGKILLed between
commands; the next command fails within the heartbeat deadline with `WorkerLostError`
naming the worker's rank, host and pid, every later command says the same, and shutting the
channel down does not hide it."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from rl_core.train.spmd import INIT, CommandChannel, WorkerLostError
from tests.helpers.trainers import channel_worker


class Local:
    def _spmd_noop(self):
        pass


def test_a_killed_worker_is_named_within_the_heartbeat_deadline():
    with channel_worker() as (store, worker):
        driver = CommandChannel(0, 2, store=store, timeout_s=600, heartbeat_timeout_s=3.0)
        driver.complete(driver.publish(INIT))
        driver.call(Local(), "noop")  # a working group
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(30)
        t0 = time.monotonic()
        with pytest.raises(WorkerLostError) as lost:
            driver.call(Local(), "noop")
        took = time.monotonic() - t0
        want = f"trainer worker rank 1 (host {socket.gethostname()}, pid {worker.pid}) stopped answering"
        assert want in str(lost.value) and "trainer.worker_heartbeat_timeout_s" in str(lost.value)
        assert 3.0 <= took < 3.0 + 10, took  # the deadline, not collective_timeout_s (600 s)
        with pytest.raises(WorkerLostError, match=want.replace("(", r"\(").replace(")", r"\)")):
            driver.call(Local(), "noop")
        driver.shutdown()  # nothing left to release: no second error
