"""A branch run's files from its source run, without ever changing the source.

Owns: `link_init_policy` (rule branch_init_policy), `branch_epoch` (rule branch_epoch),
`reuse_result` (rules branch_archive, branch_validation, branch_init_validation: a linked
epoch's `rollouts.h5` / `validation.json`, the source's, copied instead of recomputed) and
`reusable_validation` (whether a source's validation still holds for the branch).
A hard link shares the inode (bytes, mode, mtime), so only payloads written once are linked:
the files of a checkpoint or policy directory (built in a temporary directory and renamed
into place, fsutil.atomic_dir) and the spool's step files (each written atomically). What
Snakemake touches (output files) or rl_core appends to (metrics, timeline, TensorBoard) is
copied; Snakemake's `.snakemake_timestamp` markers are left for Snakemake to write.
Does not own: the branch's plan and checks (workflow.py), the rules (workflow/rules/branch.smk).
Read more: docs/workflow.md, "Rerun from a checkpoint".
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SNAKEMAKE_MARKER = ".snakemake_timestamp"  # Snakemake's mtime carrier of a directory output
# an epoch's entries a branch does not take: attempts' state (steps/, submitit/, the lock) and the
# results its own rules bring (rollouts.h5, validation.json: reused by rule when they still hold)
_NOT_TAKEN = {"steps", "submitit", ".controller.lock", "validation.json", "rollouts.h5", "rollouts.h5.manifest.json"}
_LINKED_DIRS = {"checkpoint", "rollouts.spool"}  # payload written once: linked file by file


def _copy(src: Path, dst: Path) -> None:
    shutil.copy2(src, dst)  # its own inode: touching or appending to it leaves the source alone


def _link_or_copy(src: Path, dst: Path) -> None:
    """A write-once payload file: hard-linked (no space, no time), copied across file systems."""
    try:
        os.link(src, dst)
    except OSError:
        _copy(src, dst)


def _take_tree(src: Path, dst: Path, link_payload: bool) -> dict[str, int]:
    """`src` rebuilt at `dst` (which must not exist): payload files linked when `link_payload`,
    hidden files (rl_core's marker) copied, Snakemake's markers and temporary files left out."""
    counts = {"linked": 0, "copied": 0, "bytes_copied": 0}
    dst.mkdir(parents=True)
    for item in sorted(src.iterdir()):
        target = dst / item.name
        if item.name == SNAKEMAKE_MARKER or (item.name.startswith(".") and ".tmp" in item.name):
            continue
        if item.is_dir():
            for k, v in _take_tree(item, target, link_payload).items():
                counts[k] += v
        elif link_payload and not item.name.startswith("."):
            _link_or_copy(item, target)
            counts["linked"] += 1
        else:
            _copy(item, target)
            counts["copied"] += 1
            counts["bytes_copied"] += target.stat().st_size
    return counts


def _fresh(path: Path) -> Path:
    """A hidden sibling of `path` to build in, emptied first (a killed earlier attempt's)."""
    tmp = path.with_name(f".{path.name}.branch")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def branch_epoch(src_epoch_dir: str, dst_epoch_dir: str) -> dict[str, int]:
    """An epoch of another run, taken into this run: the checkpoint verified first and placed last
    (its payload linked), the spool's step files linked, every other file copied."""
    from rl_core.checkpoint import verify_checkpoint
    from rl_core.fsutil import check_replaceable

    src, dst = Path(src_epoch_dir), Path(dst_epoch_dir)
    verify_checkpoint(src / "checkpoint")
    dst.mkdir(parents=True, exist_ok=True)
    counts = {"linked": 0, "copied": 0, "bytes_copied": 0}
    for item in sorted(src.iterdir()):
        if item.name in _NOT_TAKEN or item.name == "checkpoint" or item.name.startswith("."):
            continue
        target = dst / item.name
        if item.is_dir():
            tmp = _fresh(target)
            got = _take_tree(item, tmp, link_payload=item.name in _LINKED_DIRS)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
        else:
            tmp = target.with_name(f".{target.name}.branch")
            _copy(item, tmp)
            os.replace(tmp, target)
            got = {"copied": 1, "bytes_copied": target.stat().st_size}
        for k, v in got.items():
            counts[k] += v
    tmp = _fresh(dst / "checkpoint")
    for k, v in _take_tree(src / "checkpoint", tmp, link_payload=True).items():
        counts[k] += v
    if (dst / "checkpoint").exists():
        check_replaceable(dst / "checkpoint", "branched epoch checkpoint")  # only one rl_core wrote
        shutil.rmtree(dst / "checkpoint")
    os.replace(tmp, dst / "checkpoint")
    print(f"[branch] {src} -> {dst}: checkpoint verified; {counts['linked']} write-once files hard-linked, "
          f"{counts['copied']} files copied ({counts['bytes_copied']} bytes)", flush=True)
    return counts


def link_init_policy(src_dir: str, dst_dir: str) -> dict[str, int]:
    """A branch's initial policy: the source run's (payload hard-linked, copied across file
    systems; its marker copied), placed atomically."""
    src, dst = Path(src_dir), Path(dst_dir)
    tmp = _fresh(dst)
    counts = _take_tree(src, tmp, link_payload=True)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    print(f"[branch] {src} -> {dst} (initial policy not rebuilt: {counts['linked']} files hard-linked, "
          f"{counts['copied']} copied)", flush=True)
    return counts


def reuse_result(src: str, dst: str) -> None:
    """A linked epoch's result (its archive, a validation) as the source computed it: a copy of
    its own (Snakemake touches the outputs of the rule), written atomically."""
    a, b = Path(src), Path(dst)
    b.parent.mkdir(parents=True, exist_ok=True)
    tmp = b.with_name(f".{b.name}.branch")
    _copy(a, tmp)
    from rl_core.archive import manifest_path
    from rl_core.fsutil import atomic_write_text

    if manifest_path(a).is_file():  # an archive's checksum manifest travels with it (before the rename)
        atomic_write_text(manifest_path(b), manifest_path(a).read_text())
    os.replace(tmp, b)
    print(f"[branch] {b}: the source run's {a} ({b.stat().st_size} bytes), reused, not recomputed", flush=True)


def reusable_validation(result: Path, digest_here: Path, digest_there: Path, data: list[str]) -> bool:
    """Whether a source run's validation `result` holds for this run: the source's validation digest
    file has the same recipe values as this run's, and `result` is newer than that digest file
    and than the data it read (Snakemake's own test: the source would not rerun it)."""
    try:
        same = digest_here.read_text() == digest_there.read_text()
        t = result.stat().st_mtime
        return same and t >= digest_there.stat().st_mtime and all(t >= Path(d).stat().st_mtime for d in data)
    except OSError:
        return False
