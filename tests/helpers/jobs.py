"""Functions that run inside real local submitit jobs in the unit tests (importable by the job
process, which cannot import a test module)."""

from __future__ import annotations

import os
import signal
import time


def sigterm_self_after_install() -> str:
    """Install the controller job's local SIGTERM stop, then `kill <own pid>` (SIGTERM) and wait."""
    from rl_core.launch.job import stop_on_sigterm_locally

    assert stop_on_sigterm_locally()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    return "survived SIGTERM"


def worker_task_dies(value: int) -> int:
    """Task 1 of a two-task job is SIGKILLed (a trainer worker lost and replaced in the job); task 0,
    the driver, outlives it and returns `value`."""
    if os.environ.get("SUBMITIT_LOCAL_GLOBALID") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)
    return value
