"""Processes the tests start and stop by PID: reading a process's console to its exit."""

from __future__ import annotations

import os
import signal
import subprocess


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    """The console (stdout) of `proc`, read until it exits; past `timeout` its session (it was
    started with `start_new_session=True`) is killed by its PID and TimeoutExpired raised."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # stop what the test started, by PID
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return out
