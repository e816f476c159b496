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
