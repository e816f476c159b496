"""The environment service rl_core starts (`env.command`): it stops with its controller, whatever kills it.

Owns: starting the command in a session of its own (its process group: the service and what it
starts) with a parent-death signal (Linux `prctl(PR_SET_PDEATHSIG, SIGTERM)`: the kernel stops the
service when the controller dies, SIGKILL included); a pid file per port (`pid_file`) recording
it, so that a rerun stops what a killed controller left behind, and only that: the processes of
the recorded session whose start is not older than the recorded one's, when the recorded
controller is gone and the recorded leader is either gone or still the same process (pid, start
time, boot, command line), and the file in a folder only this user can write; stopping the
session on a normal end, at interpreter exit and before the watchdog's hard exit. Does not own: the HTTP protocol (rl_core.envs.agent). Guide: docs/agents.md.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

from rl_core.errors import RecipeError
from rl_core.fsutil import atomic_write_json
from rl_core.usercode import DaemonPool, on_hard_exit

_PARENT = DaemonPool(1, "rl_core-service-parent")  # a thread that lives as long as the process: the
# parent-death signal fires when the thread that started the child ends, not only the process
_PR_SET_PDEATHSIG = 1


def pid_file(url: str) -> Path:
    """Where the service for `url` is recorded: one file per port, per user."""
    port = urlparse(url).port or 80
    return Path(tempfile.gettempdir()) / f"rl_core-{os.getuid()}" / f"env-service-{port}.json"


def _private_dir(path: Path) -> bool:
    """Whether `path`'s folder is this user's alone (made so if missing): a record another user
    could have planted is never acted on."""
    folder = path.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(process group, session, start time in clock ticks since boot) of `pid`; None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return int(fields[2]), int(fields[3]), int(fields[19])


def _cmdline(pid: int) -> list[str]:
    try:
        return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a]
    except OSError:
        return []


def _same_process(pid: int, start: int, cmdline: list[str] | None = None) -> bool:
    st = _stat(pid)
    return st is not None and st[2] == start and (cmdline is None or _cmdline(pid) == cmdline)


def session_members(record: dict) -> list[int]:
    """The live processes of the session `record` (a pid file's content) describes, when they are
    provably the ones rl_core started: same boot, the leader gone or unchanged, each member in the
    leader's session and started no earlier than the leader. Empty otherwise."""
    pid, start = int(record["pid"]), int(record["start"])
    if record.get("boot") != _boot_id():
        return []
    if _stat(pid) is not None and not _zombie(pid) and not _same_process(pid, start, record.get("cmdline")):
        return []  # the pid belongs to another process now
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None and st[1] == pid and st[2] >= start:
            members.append(int(entry.name))
    return members


def _stop(members: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM to `members`, then SIGKILL to those still there after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in members:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while members and time.monotonic() < deadline:
            members = [p for p in members if _stat(p) is not None and not _zombie(p)]
            time.sleep(0.05)
        if not members:
            return


def _zombie(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return text[text.rindex(")") + 2:].split()[0] == "Z"


def clean_up_left_behind(url: str, command: list[str]) -> None:
    """Before starting the service for `url`: stop the one a killed controller left behind (as
    recorded in `pid_file(url)`); refuse when the recorded controller is still running."""
    path = pid_file(url)
    if not _private_dir(path):
        return
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    owner = record.get("controller") or {}
    if owner and owner.get("pid") != os.getpid() and record.get("boot") == _boot_id() \
            and _same_process(int(owner["pid"]), int(owner["start"])):
        raise RecipeError.single("env.url", url, f"a port no other run's environment service uses (the controller "
                                 f"pid {owner['pid']} runs {record.get('cmdline')} there, {path})",
                                 "wait for that run to end, stop it, or give this run another port.")
    members = session_members(record)
    if members:
        print(f"[env] stopping the environment service a killed run left on {url} (pids {members}, recorded in "
              f"{path})", flush=True)
        _stop(members)
    path.unlink(missing_ok=True)


def _die_with_parent(parent: int, prctl) -> None:
    """In the child before exec: SIGTERM when the thread that started it ends (Linux)."""
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent:  # the controller died before the signal was set
        os._exit(1)


class ServiceProcess:
    """The running service: `poll()`, `returncode`, `pid` as a Popen's; `stop()` ends its session."""

    def __init__(self, command: list[str], url: str):
        clean_up_left_behind(url, command)
        prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
        me = os.getpid()
        self.popen = _PARENT.submit(subprocess.Popen, command, stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=lambda: _die_with_parent(me, prctl)).result()
        self.pid = self.popen.pid
        st = _stat(self.pid)
        self.record = {"pid": self.pid, "start": st[2] if st else 0, "boot": _boot_id(), "cmdline": _cmdline(self.pid),
                       "command": list(command), "url": url,
                       "controller": {"pid": me, "start": (_stat(me) or (0, 0, 0))[2]}}
        self.path = pid_file(url)
        if _private_dir(self.path):
            atomic_write_json(self.path, self.record)
        atexit.register(self.stop)
        self._unhook = on_hard_exit(lambda: self.stop(grace_s=2.0))

    def poll(self) -> int | None:
        return self.popen.poll()

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the service's session (SIGTERM, then SIGKILL after `grace_s`) and remove its pid file."""
        atexit.unregister(self.stop)
        self._unhook()
        members = session_members(self.record)
        if self.popen.poll() is None and self.pid not in members:
            members.append(self.pid)
        _stop(members, grace_s)
        self.popen.poll()
        try:
            if json.loads(self.path.read_text()).get("pid") == self.pid:
                self.path.unlink()
        except (OSError, ValueError):
            pass
