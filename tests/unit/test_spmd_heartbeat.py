"""A trainer worker killed outright (fault (b) of docs/cluster.md, on one machine): rank 0's
command channel and a real worker process on a TCP store; the worker is SIGKILLed between
commands; the next command fails within the heartbeat deadline with `WorkerLostError`
naming the worker's rank, host and pid, every later command says the same, and shutting the
channel down does not hide it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from rl_core.train.spmd import INIT, CommandChannel, WorkerLostError
from tests.helpers.trainers import ROOT, free_port

WORKER = """
import sys
from datetime import timedelta
import torch.distributed as dist
from rl_core.train.spmd import CommandChannel

class Target:
    def _spmd_noop(self):
        pass

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False, timeout=timedelta(seconds=60))
CommandChannel(1, 2, store=store).serve(lambda **kwargs: Target())
"""


class Local:
    def _spmd_noop(self):
        pass


def test_a_killed_worker_is_named_within_the_heartbeat_deadline():
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(port)], cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
    try:
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
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
