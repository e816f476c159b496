"""Filesystem weight handoff: one safetensors directory per weight version, plus a ready marker.

Owns: the layout under the root (`v000000012/*.safetensors` with HF names, sharded by size;
`v000000012/READY`, JSON written last; `LATEST`, a hint), the writer (trainer rank 0: a
version built in a hidden sibling, fsynced, renamed into place, then `READY` and `LATEST`
written atomically, so a reader that sees `READY` sees complete files, also across nodes; all
but the newest `keep_last_versions` versions and any temporary left by a killed writer
deleted after a publish), and the readers (`read_version`, `wait_for_version`: ready versions
only, file sizes checked). Tied weights are written as two tensors (safetensors refuses
shared storage); readers get both names.

Does not own: what the weights are (the trainer's `export_weights`) or when to publish.

Read more: docs/distributed-training.md, "Weight sync (refit)".
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Iterable, Mapping

import torch

from rl_core.fsutil import atomic_write_json, fsync_dir
from rl_core.types import SyncReport
from rl_core.weights.base import state_dict_bytes

READY = "READY"
LATEST = "LATEST"
_VERSION_RE = re.compile(r"^v(\d{9})$")


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version:09d}"


def _ready_versions(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _VERSION_RE.match(p.name)
        if m and (p / READY).is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def latest_ready_version(root: str | Path) -> int | None:
    """The newest version whose READY marker exists, or None."""
    versions = _ready_versions(Path(root))
    return versions[-1] if versions else None


def read_version(root: str | Path, version: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of a ready version; FileNotFoundError if it is not (yet, or any more) ready."""
    from safetensors.torch import load_file

    d = version_dir(root, version)
    marker = d / READY
    if not marker.is_file():
        raise FileNotFoundError(f"weight version {version} is not ready under {root} (no {marker})")
    meta = json.loads(marker.read_text())
    state: dict[str, torch.Tensor] = {}
    for name, size in meta["files"].items():
        f = d / name
        if f.stat().st_size != size:
            raise OSError(f"{f} has {f.stat().st_size} bytes, its READY marker says {size}: the version is corrupt")
        state.update(load_file(str(f), device=device))
    return state


def wait_for_version(root: str | Path, version: int, timeout_s: float, poll_s: float = 0.05) -> int:
    """Block until a version >= `version` is ready; returns the newest ready one."""
    deadline = time.monotonic() + timeout_s
    while True:
        latest = latest_ready_version(root)
        if latest is not None and latest >= version:
            return latest
        if time.monotonic() > deadline:
            raise TimeoutError(f"no weight version >= {version} became ready under {root} within {timeout_s:.0f}s "
                               f"(newest ready: {latest})")
        time.sleep(poll_s)


def _shards(weights: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    seen: set[tuple[int, int]] = set()
    for name, t in weights.items():
        t = t.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        t = t.to("cpu").clone() if key in seen else t.to("cpu").contiguous()
        seen.add(key)
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


class FilesystemWeightSync:
    """`trainer.weight_sync.type: filesystem` (see the module doc)."""

    kind = "filesystem"
    sends_from_device = False  # files are written from host memory

    @classmethod
    def from_recipe(cls, cfg, run_dir: str | Path) -> "FilesystemWeightSync":
        """The registry's builder (`rl_core.weights.WEIGHT_SYNCS`): `trainer.weight_sync.dir`, else
        `<run_dir>/weights`."""
        ws = cfg.trainer.weight_sync
        root = Path(ws.dir) if ws.dir else Path(run_dir) / "weights"
        return cls(root, keep_last_versions=ws.keep_last_versions)

    def __init__(self, root: str | Path, keep_last_versions: int = 2, max_shard_mb: float = 2048.0):
        if keep_last_versions < 1:
            raise ValueError("keep_last_versions must be >= 1")
        self.root = Path(root)
        self.keep_last_versions = keep_last_versions
        self.max_shard_bytes = int(max_shard_mb * 2**20)
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_partial()

    def write(self, version: int, weights: Mapping[str, torch.Tensor]) -> SyncReport:
        """Publish `weights` as ready version `version` (blocking); returns bytes and seconds."""
        from safetensors.torch import save_file

        t0 = time.monotonic()
        final = version_dir(self.root, version)
        tmp = self.root / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            shards = _shards(weights, self.max_shard_bytes)
            files: dict[str, int] = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt", "weight_version": str(version)})
                with open(tmp / name, "rb") as fh:
                    os.fsync(fh.fileno())
                files[name] = (tmp / name).stat().st_size
            fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        nbytes = state_dict_bytes(weights)
        atomic_write_json(final / READY, {"version": version, "files": files, "num_tensors": len(weights),
                                          "tensor_bytes": nbytes, "written_at": time.time()})
        atomic_write_json(self.root / LATEST, {"version": version})
        write_s = time.monotonic() - t0
        self.cleanup()
        return SyncReport(self.kind, version, nbytes, write_s, {"write_s": write_s,
                                                                  "file_bytes": float(sum(files.values()))})

    def cleanup(self) -> list[int]:
        """Delete ready versions older than the newest `keep_last_versions`; returns the deleted ones."""
        versions = _ready_versions(self.root)
        old = versions[: max(0, len(versions) - self.keep_last_versions)]
        for v in old:
            d = version_dir(self.root, v)
            (d / READY).unlink(missing_ok=True)  # unready first: no reader starts on it any more
            shutil.rmtree(d, ignore_errors=True)
        return old

    def _remove_partial(self) -> None:
        for p in self.root.iterdir():
            if p.name.startswith(".v") and ".tmp-" in p.name:
                shutil.rmtree(p, ignore_errors=True)
            elif _VERSION_RE.match(p.name) and not (p / READY).is_file():
                shutil.rmtree(p, ignore_errors=True)  # renamed into place but never marked ready

    async def push(self, version: int, weights: Mapping[str, torch.Tensor], backends: Iterable) -> SyncReport:
        """Write the version (off the event loop), then have every backend load it from the directory."""
        report = await asyncio.to_thread(self.write, version, weights)
        t0 = time.monotonic()
        path = version_dir(self.root, version)
        for backend in backends:
            await backend.update_weights(version, path)
        load_s = time.monotonic() - t0
        report.parts["load_s"] = load_s
        report.seconds += load_s
        return report
