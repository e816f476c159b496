"""Checkpoint directories: atomic writes, a manifest written last, verification on load.

Owns: the on-disk layout of a checkpoint (`model/` HF directory, `optimizer.pt`, `rng.pt`,
`controller_state.json`, `buffer.json`, `resolved_config.json`, `manifest.json` with every
file's size and sha256, the `.rl_core-output` marker), writing it atomically (a hidden
sibling directory, the manifest last, then a rename), verifying every file before anything
is loaded, and safe loading (safetensors, `torch.load(weights_only=True)` or JSON; no
pickle). A malformed manifest is a `CheckpointError` naming it; a full disk while writing
names the previous intact checkpoint; `prune` deletes only checkpoints rl_core wrote.

Does not own: what the controller puts in its state (controller.state) or when to save.

Read more: docs/workflow.md, "Inspecting a run" (the layout) and "Recovery".
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

from rl_core.errors import CheckpointError
from rl_core.fsutil import MARKER, atomic_dir, sha256_file  # noqa: F401  (sha256_file: re-exported)

FORMAT = "rl_core.checkpoint/1"
MANIFEST = "manifest.json"
_RESUME_FIX = "`rl-core train RECIPE --resume-from <checkpoint>`, or rerun the same command to fall back to the newest intact one"


def _manifest(root: Path, meta: dict[str, Any]) -> dict[str, Any]:
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name not in (MANIFEST, MARKER):  # the ownership marker is not content
            rel = p.relative_to(root).as_posix()
            files[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    return {"format": FORMAT, **meta, "files": files}


def write_checkpoint(final_dir: str | os.PathLike, fill: Callable[[Path], None], meta: dict[str, Any]) -> Path:
    """Build a checkpoint with `fill(tmp_dir)`, hash everything, write the manifest last, rename.

    A full disk (ENOSPC / EDQUOT) while writing becomes a `CheckpointError` that says so:
    the half-written temporary is removed, and the newest earlier checkpoint beside it is
    untouched (named in the message) so the same command resumes from it once there is room.
    """
    final = Path(final_dir)
    try:
        with atomic_dir(final, "checkpoint") as tmp:
            fill(tmp)
            manifest = _manifest(tmp, meta)
            with open(tmp / MANIFEST, "w") as fh:
                json.dump(manifest, fh, indent=2)
                fh.flush()
                os.fsync(fh.fileno())
    except Exception as exc:  # noqa: BLE001 - only a full disk is translated, the rest re-raised as is
        if not _disk_full(exc):
            raise
        prev = newest_complete(final.parent, final.name.split("_")[0] + "_") if final.parent.is_dir() else None
        kept = (f"The previous checkpoint {prev} is intact and the run resumes from it"
                if prev is not None and prev != final else
                "No earlier checkpoint of this run exists, so a rerun starts from the beginning")
        raise CheckpointError(
            f"No space left on the device while writing checkpoint {final} ({exc}); the partial write was removed. "
            f"{kept}. Fix: free space on the file system of {final.parent} (see `df -h {final.parent}`), or keep "
            f"fewer checkpoints (checkpoint.keep_last) or point output_dir at a larger disk, then rerun the same "
            f"command.") from None
    return final


def _disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a full disk or quota; torch/safetensors wrap the OSError."""
    import errno

    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path) / MANIFEST
    if not p.is_file():
        raise CheckpointError(
            f"Checkpoint {path} is incomplete: {p} is missing (a writer was killed before finishing, or this is "
            f"not a checkpoint directory). Fix: resume from an earlier checkpoint ({_RESUME_FIX}).")
    try:
        manifest = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"Checkpoint manifest {p} cannot be read as JSON ({exc}). Fix: move the checkpoint "
                              f"directory {path} away and resume from an earlier one ({_RESUME_FIX}).") from None
    problem = None
    if not isinstance(manifest, dict):
        problem = f"is a JSON {type(manifest).__name__}, expected an object"
    elif not isinstance(manifest.get("files"), dict):
        problem = "has no `files` object (path -> size and sha256)"
    else:
        for rel, info in manifest["files"].items():
            if not (isinstance(info, dict) and isinstance(info.get("size"), int) and isinstance(info.get("sha256"), str)):
                problem = f"lists file {rel!r} without an integer `size` and a string `sha256`"
                break
    if problem is not None:
        raise CheckpointError(f"Checkpoint manifest {p} {problem}; it was not written by rl_core or was edited. "
                              f"Fix: move the checkpoint directory {path} away and resume from an earlier one "
                              f"({_RESUME_FIX}).")
    return manifest


def verify_checkpoint(path: str | os.PathLike, hashes: bool = True) -> dict[str, Any]:
    """Check every file against the manifest; raises CheckpointError naming the first bad file."""
    root = Path(path)
    manifest = read_manifest(root)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"Checkpoint {root} has format {manifest.get('format')!r}; expected {FORMAT!r}. "
                              "Fix: use a checkpoint written by this version of rl_core.")
    for rel, info in manifest["files"].items():
        f = root / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"Checkpoint manifest {root / MANIFEST} lists {rel!r}, a path outside the checkpoint. "
                                  f"Fix: use a checkpoint written by rl_core ({_RESUME_FIX}).")
        if not f.is_file():
            raise CheckpointError(f"Checkpoint file {f} is missing (listed in {root / MANIFEST}). "
                                  f"Fix: restore the file or resume from another checkpoint ({_RESUME_FIX}).")
        size = f.stat().st_size
        if size != info["size"]:
            raise CheckpointError(f"Checkpoint file {f} has {size} bytes; the manifest says {info['size']} "
                                  f"(truncated or overwritten). Fix: resume from another checkpoint ({_RESUME_FIX}).")
        if hashes and sha256_file(f) != info["sha256"]:
            raise CheckpointError(f"Checkpoint file {f} does not match its sha256 in {root / MANIFEST} "
                                  f"(corrupted). Fix: resume from another checkpoint ({_RESUME_FIX}).")
    return manifest


# --------------------------------------------------------------------------- state pieces


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": json.dumps(random.getstate()),
             "numpy": {"keys": torch.from_numpy(np_state[1].astype("int64")), "pos": int(np_state[2]),
                       "gauss": [int(np_state[3]), float(np_state[4])]}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    py = json.loads(state["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype("uint32"), n["pos"], n["gauss"][0], n["gauss"][1]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_torch(path: Path) -> Any:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - reported with the file name
        raise CheckpointError(f"Checkpoint file {path} cannot be loaded ({type(exc).__name__}: {exc}). "
                              "Fix: resume from another checkpoint.") from None


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"Checkpoint file {path} cannot be read ({exc}). "
                              "Fix: resume from another checkpoint.") from None


def checkpoint_order(name: str, prefix: str = "step_") -> tuple[int, int]:
    """Sort key of `step_000012` (a step boundary) and `step_000012_opt000050` (between the
    mini-steps of RL step 12, after 50 optimizer steps): boundary first, then by optimizer step."""
    rest = name[len(prefix):]
    step, _, opt = rest.partition("_opt")
    if not step.isdigit() or (opt and not opt.isdigit()):
        return (-1, -1)
    return (int(step), int(opt) if opt else -1)


def _complete_children(root: Path, prefix: str) -> list[Path]:
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith(prefix) and is_complete(p)
                   and checkpoint_order(p.name, prefix) >= (0, -1)), key=lambda p: checkpoint_order(p.name, prefix))


def newest_complete(parent: str | os.PathLike, prefix: str = "step_") -> Path | None:
    """The newest complete checkpoint under `parent` (incomplete ones are skipped)."""
    root = Path(parent)
    if not root.is_dir():
        return None
    cands = _complete_children(root, prefix)
    return cands[-1] if cands else None


def prune(parent: str | os.PathLike, keep_last: int, prefix: str = "step_") -> None:
    """Keep the newest `keep_last` complete checkpoints; remove older ones (only those rl_core wrote:
    marker file or rl_core manifest) and stale temporaries."""
    from rl_core.fsutil import has_marker

    root = Path(parent)
    if not root.is_dir():
        return
    complete = _complete_children(root, prefix)
    for p in complete[:-keep_last] if keep_last > 0 else complete:
        try:
            ours = has_marker(p) or str(read_manifest(p).get("format", "")).startswith("rl_core.checkpoint/")
        except CheckpointError:
            ours = False
        if ours:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():
        if p.name.startswith(".") and ".tmp" in p.name:
            shutil.rmtree(p, ignore_errors=True)
