"""Sharded checkpoints (`torch.distributed.checkpoint`, DCP) whose metadata is JSON, not pickle.

Owns: `JsonMetadataWriter`, `JsonMetadataReader`, `SafeLoadPlanner` and `load_sharded`, which
`FSDPTrainer.save_checkpoint` / `load_checkpoint` use around `dcp.save` / `dcp.load`, and the
JSON form of DCP's `Metadata`. Stock DCP reads `.metadata` with `pickle.load` and non-tensor
entries with an unrestricted `torch.load`, so a crafted checkpoint could run code in every
rank that loads it. Here the writer adds `metadata.json` beside `.metadata` (kept for DCP's
tools), the reader builds `Metadata` from that JSON only (`.metadata` is never opened), and
the planner reads non-tensor entries with `torch.load(weights_only=True)`. A refusal is a
`CheckpointError` naming the file.

Does not own: the checkpoint layout, its atomic rename or the run checkpoint's manifest
(`rl_core.train.fsdp`, `rl_core.checkpoint.store`). Read more: docs/distributed-training.md,
"Checkpoints".
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from rl_core.errors import CheckpointError

JSON_METADATA = "metadata.json"
FORMAT = "rl_core.dcp_metadata/1"
_FIX = "Fix: pass a sharded checkpoint directory written by FSDPTrainer.save_checkpoint."


def _torch_attr(name: Any, kind: type, what: str) -> Any:
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, kind):
        raise ValueError(f"{what} {name!r} is not a torch {kind.__name__}")
    return value


def _name(value: Any) -> str:
    return str(value).removeprefix("torch.")


def _ints(values: Any, what: str) -> torch.Size:
    if not isinstance(values, list) or not all(type(v) is int and v >= 0 for v in values):
        raise ValueError(f"{what} must be a list of non-negative integers, got {values!r}")
    return torch.Size(values)


def metadata_to_json(md: _md.Metadata) -> dict[str, Any]:
    """The plain-JSON form of a DCP `Metadata` as `dcp.save` with the default planner writes it."""
    entries = {}
    for fqn, sm in md.state_dict_metadata.items():
        if isinstance(sm, _md.BytesStorageMetadata):
            entries[fqn] = {"kind": "bytes"}
            continue
        p = sm.properties
        entries[fqn] = {"kind": "tensor", "dtype": _name(p.dtype), "layout": _name(p.layout),
                        "requires_grad": bool(p.requires_grad), "memory_format": _name(p.memory_format),
                        "pin_memory": bool(p.pin_memory), "size": list(sm.size),
                        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in sm.chunks]}
    storage = []
    for index, info in (md.storage_data or {}).items():
        storage.append({"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset),
                        "index": index.index, "relative_path": info.relative_path, "file_offset": info.offset,
                        "length": info.length, "transforms": list(info.transform_descriptors or [])})
    planner = None if md.planner_data is None else {k: list(v) for k, v in md.planner_data.items()}
    return {"format": FORMAT, "version": md.version, "state_dict_metadata": entries, "planner_data": planner,
            "storage_data": storage}


def metadata_from_json(data: Any) -> _md.Metadata:
    """Rebuild a `Metadata` from `metadata_to_json`'s form; anything else raises ValueError."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"expected a JSON object with format {FORMAT!r}")
    entries: dict[str, Any] = {}
    for fqn, e in data.get("state_dict_metadata", {}).items():
        if not isinstance(e, dict) or e.get("kind") not in ("tensor", "bytes"):
            raise ValueError(f"entry {fqn!r} is not a tensor or bytes entry")
        if e["kind"] == "bytes":
            entries[fqn] = _md.BytesStorageMetadata()
            continue
        props = _md.TensorProperties(
            dtype=_torch_attr(e.get("dtype"), torch.dtype, "dtype"),
            layout=_torch_attr(e.get("layout", "strided"), torch.layout, "layout"),
            requires_grad=bool(e.get("requires_grad", False)),
            memory_format=_torch_attr(e.get("memory_format", "contiguous_format"), torch.memory_format,
                                      "memory_format"),
            pin_memory=bool(e.get("pin_memory", False)))
        chunks = [_md.ChunkStorageMetadata(offsets=_ints(c.get("offsets"), "chunk offsets"),
                                           sizes=_ints(c.get("sizes"), "chunk sizes"))
                  for c in e.get("chunks", []) if isinstance(c, dict)]
        entries[fqn] = _md.TensorStorageMetadata(properties=props, size=_ints(e.get("size"), "size"), chunks=chunks)
    storage: dict[_md.MetadataIndex, _StorageInfo] = {}
    for s in data.get("storage_data", []):
        if not isinstance(s, dict) or not isinstance(s.get("fqn"), str):
            raise ValueError(f"storage entry {s!r} has no string fqn")
        rel = s.get("relative_path")
        if not isinstance(rel, str) or "\x00" in rel or Path(rel).name != rel or rel in ("", ".", ".."):
            raise ValueError(f"storage entry {s['fqn']!r} names file {rel!r} outside the checkpoint directory "
                             f"(or not a file name: a NUL byte, a path)")
        if not all(type(s.get(k)) is int and s[k] >= 0 for k in ("file_offset", "length")):
            raise ValueError(f"storage entry {s['fqn']!r} has no non-negative integer file_offset / length")
        if s.get("index") is not None and type(s["index"]) is not int:
            raise ValueError(f"storage entry {s['fqn']!r} has a non-integer index")
        transforms = s.get("transforms") or None
        if transforms is not None and not all(isinstance(t, str) for t in transforms):
            raise ValueError(f"storage entry {s['fqn']!r} has non-string transforms")
        offset = None if s.get("offset") is None else _ints(s["offset"], "offset")
        storage[_md.MetadataIndex(s["fqn"], offset, s.get("index"))] = _StorageInfo(
            rel, s["file_offset"], s["length"], transforms)
    planner = data.get("planner_data")
    if planner is not None:
        if not isinstance(planner, dict) or not all(
                isinstance(v, list) and all(isinstance(x, (str, int)) for x in v) for v in planner.values()):
            raise ValueError("planner_data must map names to lists of keys")
        planner = {k: tuple(v) for k, v in planner.items()}
    version = data.get("version")
    return _md.Metadata(state_dict_metadata=entries, planner_data=planner, storage_data=storage,
                        version=version if isinstance(version, str) else None)


class JsonMetadataWriter(FileSystemWriter):
    """DCP's file-system writer, plus `metadata.json` (the pickle-free metadata)."""

    def finish(self, metadata: _md.Metadata, results: Any) -> None:
        super().finish(metadata, results)  # fills metadata.storage_data and writes DCP's own .metadata
        from rl_core.fsutil import atomic_write_text

        atomic_write_text(Path(self.path) / JSON_METADATA, json.dumps(metadata_to_json(metadata)))


class JsonMetadataReader(FileSystemReader):
    """DCP's file-system reader with the metadata read from `metadata.json` (never `.metadata`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> _md.Metadata:
        path = Path(self.path) / JSON_METADATA
        if kwargs.get("rank") is not None:  # DCP asks for per-rank metadata only of checkpoints saved without collectives
            raise CheckpointError(f"The sharded checkpoint {self.path} has no per-rank metadata. {_FIX}")
        if "\x00" in str(path):  # no file system accepts it (open raises ValueError)
            raise CheckpointError(f"The sharded checkpoint path {str(self.path)!r} holds a NUL byte; expected a "
                                  f"directory path. {_FIX}")
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"The sharded checkpoint metadata {path} cannot be read ({exc.strerror or exc}); "
                                  f"expected the JSON metadata rl_core writes beside DCP's shards. {_FIX}") from None
        try:
            metadata = metadata_from_json(json.loads(raw))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CheckpointError(f"The sharded checkpoint metadata {path} is malformed ({exc}); expected the JSON "
                                  f"metadata rl_core writes beside DCP's shards. {_FIX}") from None
        metadata.storage_meta = _md.StorageMeta(load_id=self.load_id)
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor entries read by `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:  # UnpicklingError of a refused global, a damaged entry, ...
            raise CheckpointError(f"The sharded checkpoint entry {read_item.dest_index.fqn!r} was refused "
                                  f"({type(exc).__name__}: {str(exc)[:300]}); expected plain values (numbers, "
                                  f"strings, tensors). {_FIX}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_sharded(state: dict[str, Any], path: str | Path) -> None:
    """`dcp.load` of `state` from the sharded checkpoint directory `path` through the reader and
    planner above. Each rank reads the JSON metadata first, so a damaged or crafted one is a
    plain `CheckpointError` (not DCP's wrapped `CheckpointException`, a BaseException), and a
    refused entry is re-raised as the `CheckpointError` it is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    JsonMetadataReader(str(path)).read_metadata()
    try:
        dcp.load(state, storage_reader=JsonMetadataReader(str(path)), planner=SafeLoadPlanner())
    except CheckpointException as exc:
        ours = [e for e, _ in exc.failures.values() if isinstance(e, CheckpointError)]
        if ours:
            raise ours[0] from None
        first = next(iter(exc.failures.values()), (exc, None))[0]
        raise CheckpointError(f"The sharded checkpoint {path} could not be read ({type(first).__name__}: "
                              f"{str(first)[:300]}). {_FIX}") from None
