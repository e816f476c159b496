"""docs/workflow.md "Recovery", item "A killed snakemake", done the way a user would, on a copy of the reference run.

Retraining epoch 2 (`--forcerun results/short/epoch_2/checkpoint`, docs/workflow.md "Rerun from a
checkpoint" (c)) is started; once its controller job holds the epoch's lock, the snakemake
process alone gets SIGKILL (`kill -9 <pid>`), not its process group. Then, in docs/workflow.md's
order:
- the controller job keeps running (the pid named by `epoch_2/.controller.lock` is alive);
- step 1: the same command again refuses with snakemake's lock error; `--unlock` (same
  `--config`) removes the lock and runs nothing;
- step 2: the controller is stopped by that pid with `kill -9`; the rule's waiting process and
  submitit's local process then exit on their own;
- step 3: the same command with `--rerun-incomplete` trains epoch 2 again (from its newest
  intact step checkpoint if one was written, else from epoch 1's checkpoint) and completes
  the workflow; `snakemake -n` then has nothing to do; epoch 2's checkpoint verifies and its
  weights and optimizer state equal the reference run's bit for bit (the short recipe is
  reproducible).
An epoch of the short recipe takes a few seconds, a real one hours: so that the controller is
still running at every step however loaded the machine is, the test holds it with SIGSTOP
from the moment it holds its lock until it is killed (a stopped process is alive and keeps its
lock; this changes nothing else). Every process this test started is stopped by its pid at
the end, the orphaned controller included.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from rl_core.checkpoint import verify_checkpoint

from tests.helpers.workflow import RUN, copy_run, manifest, short_config, snakemake

SAME_BITS = ("model/model.safetensors", "optimizer.pt")


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, session id) of a process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # state ppid pgrp session ...
    return fields[0], int(fields[2]), int(fields[3])


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _session(sid: int) -> set[int]:
    """Live processes of session `sid` (snakemake runs in its own: every job it started is in it)."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None and st[2] == sid and st[0] not in ("Z", "X"):
            out.add(int(entry))
    return out


def _lock_pid(epoch_dir: Path) -> int | None:
    try:
        return int(json.loads((epoch_dir / ".controller.lock").read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _wait(cond, timeout: float, what: str, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc is None or proc.poll() is None, f"snakemake exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.02)


def _text(out) -> str:
    return out.stdout + out.stderr


def _files(wd: Path) -> list[str]:
    return sorted(str(p.relative_to(wd)) for p in wd.rglob("*") if ".snakemake" not in p.parts)


def test_killed_snakemake_recovers_as_the_readme_says(reference_run, tmp_path):
    wd = copy_run(reference_run, tmp_path / "wd")
    r = wd / "results" / RUN
    e2 = r / "epoch_2"
    base = ["--cores", "2", *short_config()]
    command = [*base, "--forcerun", f"results/{RUN}/epoch_2/checkpoint"]
    log = open(tmp_path / "snakemake.out", "w+")
    proc = snakemake(wd, *command, popen=True, stdout=log)
    sid = proc.pid  # start_new_session: snakemake leads its own session
    controller = None
    try:
        # the lock still names the reference run's controller until this run's takes it
        _wait(lambda: (pid := _lock_pid(e2)) is not None and pid in _session(sid), 600,
              "epoch 2's controller job to hold its lock", proc)
        controller = _lock_pid(e2)
        os.kill(controller, signal.SIGSTOP)  # held: see the module docstring
        assert not (e2 / "checkpoint").exists() and not (e2 / "summary.json").exists(), "epoch 2 ended already"

        # `kill -9` of the snakemake process alone, not its process group (the controller is in it)
        assert _stat(controller)[1] == proc.pid
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert _alive(controller), "the controller job died with snakemake"

        # docs/workflow.md step 1: the same command refuses while snakemake's lock is left; --unlock runs nothing
        again = snakemake(wd, *command)
        assert again.returncode != 0, _text(again)[-3000:]
        assert "LockException" in _text(again) and "Directory cannot be locked" in _text(again), \
            _text(again)[-3000:]
        assert "--unlock" in _text(again)
        before = _files(wd)
        unlock = snakemake(wd, *base, "--unlock")
        assert unlock.returncode == 0, _text(unlock)[-3000:]
        assert "Unlocked working directory" in _text(unlock) and "Job stats" not in _text(unlock), _text(unlock)
        assert _files(wd) == before
        assert _alive(controller), "--unlock touched the running controller job"

        # docs/workflow.md step 2: stop the controller by the pid its lock names; what it leaves exits on its own
        assert _lock_pid(e2) == controller
        os.kill(controller, signal.SIGKILL)
        _wait(lambda: not _alive(controller), 30, f"controller pid {controller} to exit")
        _wait(lambda: not _session(sid), 60, "the killed run's waiting rule and submitit processes to exit")
        assert not (e2 / "checkpoint").exists() and not (e2 / "summary.json").exists()
        steps = sorted(p.name for p in (e2 / "steps").glob("step_*") if (p / "manifest.json").is_file()) \
            if (e2 / "steps").is_dir() else []

        # docs/workflow.md step 3: the same command with --rerun-incomplete completes; then nothing is left to do
        rerun = snakemake(wd, *command, "--rerun-incomplete")
        assert rerun.returncode == 0, _text(rerun)[-4000:]
        log2 = (r / "logs" / "train_epoch_2.log").read_text().rsplit("=== train_epoch ", 2)
        assert log2[-1].startswith("done") and "started" in log2[-2], log2[-2:]
        if steps:
            assert f"[resume] epoch 2: continuing from results/{RUN}/epoch_2/steps/{steps[-1]}" in log2[-2]
        else:
            assert "[resume]" not in log2[-2] and f"from results/{RUN}/epoch_1/checkpoint into" in log2[-2]
        dry = snakemake(wd, *base, "-n")
        assert dry.returncode == 0 and "Nothing to be done" in _text(dry), _text(dry)[-3000:]

        got = verify_checkpoint(e2 / "checkpoint")
        want = manifest(reference_run / "results" / RUN / "epoch_2" / "checkpoint")
        assert got["rl_step"] == want["rl_step"] == 12
        for f in SAME_BITS:
            assert got["files"][f]["sha256"] == want["files"][f]["sha256"], f"epoch 2: {f} differs from the reference"
        assert json.loads((e2 / "summary.json").read_text())["end_step"] == 12
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        # the orphans: every process still in snakemake's session (the session id survives
        # re-parenting, and a reused pid would not carry it), the held controller included
        for pid in sorted(_session(sid) | ({controller} if controller else set())):
            if (st := _stat(pid)) is not None and st[2] == sid:
                os.kill(pid, signal.SIGKILL)
