"""Reading a W&B offline run (`run-<id>.wandb`) back: the records of its transaction log,
decoded with wandb's own protobuf schema (`wandb.proto.wandb_internal_pb2.Record`).

The file is a LevelDB-style log (github.com/google/leveldb, doc/log_format.md): a 7-byte
header (`:W&B`, magic 0xBEE1, version 0), then 32 KiB blocks of records, each
`crc32 (4) | length (2) | type (1) | data`, the type saying whether the data is a whole
record or its first, middle or last piece; W&B's checksum is zlib's CRC-32 of the type
byte and the data. wandb itself no longer ships a Python reader (its Go core reads the
file), so the tests read it here and check every checksum."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> list[bytes]:
    data = Path(path).read_bytes()
    ident, magic, version = data[:4], *struct.unpack("<HB", data[4:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a W&B log ({data[:7]!r})"
    out, piece, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's trailer
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if (crc, length, kind) == (0, 0, 0):  # zero padding
            pos += left
            continue
        payload = data[pos + HEADER:pos + HEADER + length]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad checksum at byte {pos}"
        pos += HEADER + length
        if kind == FULL:
            out.append(payload)
        elif kind == FIRST:
            piece = payload
        elif kind == MIDDLE:
            piece += payload
        elif kind == LAST:
            out.append(piece + payload)
        else:
            raise AssertionError(f"{path}: record type {kind} at byte {pos}")
    return out


def history(path: str | Path) -> list[dict]:
    """The rows of `run.log` calls, in order: {key: value} (nested keys joined with '/')."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for raw in records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows


def run_file(run_dir: str | Path) -> Path:
    """The transaction log of one offline run directory (offline-run-<time>-<id>/)."""
    files = sorted(Path(run_dir).glob("run-*.wandb"))
    assert len(files) == 1, f"{run_dir}: expected one run-*.wandb, found {files}"
    return files[0]
