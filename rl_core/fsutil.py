"""Atomic file-system writes: a reader never sees a half-written file or directory.

Owns: write-to-temporary-then-rename for files (`atomic_write_text`, `atomic_write_json`)
and directories (`atomic_dir`: build in a hidden sibling, rename into place), and the
ownership rule of output directories: every directory rl_core builds this way carries a
marker file (`.rl_core-output`, JSON: what wrote it, when, which process), and an existing
directory is only ever replaced when it carries that marker (or is empty); anything else
at the target (a user's directory, a file) is refused with an `OutputPathError`
(`check_replaceable`). Files inside such a directory get the mode an ordinary `open()`
gives (0644 under umask 022; transformers' `save_pretrained` writes its safetensors
0600, which other users of a shared file system cannot read): `normalize_file_modes`; a
file's sha256 (`sha256_file`, read in chunks).

Does not own: what is written (checkpoints, results, configs).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any, Iterator


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


# --------------------------------------------------------------------------- ownership

MARKER = ".rl_core-output"


def write_marker(directory: str | os.PathLike, what: str) -> Path:
    """Mark `directory` as written by rl_core (`what`: e.g. "checkpoint", "init-policy")."""
    from datetime import datetime, timezone

    path = Path(directory) / MARKER
    info = {"written_by": f"rl_core {what}", "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "pid": os.getpid()}
    with open(path, "w") as fh:
        fh.write(json.dumps(info, indent=1) + "\n")
    return path


def has_marker(directory: str | os.PathLike) -> bool:
    return (Path(directory) / MARKER).is_file()


def check_replaceable(path: str | os.PathLike, what: str = "output directory", option: str | None = None) -> None:
    """Raise `OutputPathError` unless `path` is missing, an empty directory, or a directory rl_core wrote
    (it carries the marker file, or is a checkpoint with an rl_core manifest)."""
    from rl_core.errors import OutputPathError

    p = Path(path)
    named = f"{what} {p}" + (f" (option `{option}`)" if option else "")
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        raise OutputPathError(
            f"The {named} exists and is not a directory; rl_core does not delete or overwrite files it did not "
            f"write. Fix: choose another path, or move {p} away yourself.")
    if not p.exists() or not any(p.iterdir()) or has_marker(p) or _is_rl_core_checkpoint(p):
        return
    raise OutputPathError(
        f"The {named} exists and was not written by rl_core (it has no {MARKER} marker file); rl_core does not "
        f"delete or overwrite a directory it did not create. Fix: choose another path, or move {p} away yourself.")


def _is_rl_core_checkpoint(p: Path) -> bool:
    """A checkpoint written before markers existed: its manifest names rl_core's format."""
    try:
        manifest = json.loads((p / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and str(manifest.get("format", "")).startswith("rl_core.checkpoint/")


def normalize_file_modes(root: str | os.PathLike) -> None:
    """Give every file under `root` the permission bits an ordinary `open()` gives here (the mode of
    the marker file, or of a probe file): what umask allows, no more and no less."""
    root = Path(root)
    ref_path = root / MARKER
    probe = None
    if not ref_path.is_file():
        probe = ref_path = root / f".mode-probe{os.getpid()}"
        ref_path.write_text("")
    try:
        mode = ref_path.stat().st_mode & 0o777
    finally:
        if probe is not None:
            probe.unlink(missing_ok=True)
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink() and (p.stat().st_mode & 0o777) != mode:
            os.chmod(p, mode)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, what: str = "output") -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces `final` in one rename.

    The directory gets the rl_core marker (`what` says what wrote it) and its files the
    ordinary mode. An existing `final` is replaced only if rl_core wrote it (else
    `OutputPathError`, raised before anything is written)."""
    final = Path(final)
    check_replaceable(final, what)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write_marker(tmp, what)
        yield tmp
        normalize_file_modes(tmp)
        fsync_dir(tmp)
        if final.exists():
            check_replaceable(final, what)  # still ours (nothing swapped in while we wrote)
            old = final.with_name(f".{final.name}.old{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """The hex sha256 of a file's bytes, read `chunk` bytes at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()
