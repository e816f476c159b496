"""Weight broadcast from trainer rank 0 to generation processes, in buckets.

Owns: `BroadcastGroup` (trainer rank 0 and the G generation processes as a process group of
their own, met at a TCP store rank 0 hosts: gloo on CPU, NCCL on GPU; generation never joins
the trainer's world); one sync, `WeightBroadcaster.send` -> `WeightReceiver.recv`: a JSON
header (version, names, dtypes, shapes; parsed strictly by `parse_header`, anything else a
`BroadcastHeaderError`: nothing is unpickled or evaluated) then the tensors packed as raw bytes
into buckets of at most `bucket_size_mb`, each one broadcast, sliced back and loaded with
`engine.update_weights` (tied weights travel once); `BroadcastWeightSync`, the refit transport
of `trainer.weight_sync.type: broadcast` to an `HttpBackend`'s servers, local or on other nodes
(a new group when they change; a restarted server caught up).

Does not own: starting generation processes or deciding when to sync (refit). Read more:
docs/distributed-training.md, "Weight sync (refit)".
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

import torch

from rl_core.types import SyncReport

HEADER_FORMAT = "rl_core.weights.broadcast/1"
MAX_HEADER_BYTES = 64 * 2**20  # ~1M tensors of long names: far above any model, far below a memory problem
MAX_DIMS = 8
MAX_TENSOR_ELEMENTS = 2**40
# the dtypes a header may name (torch's own names without the "torch." prefix); nothing else is looked up
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in (
    "float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool",
    "float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)}


class BroadcastHeaderError(ValueError):
    """A broadcast header that is not what `WeightBroadcaster` sends (refused, never evaluated)."""


def encode_header(version: int, entries: list[tuple[str, str, tuple[int, ...], str | None]]) -> bytes:
    """The header's bytes: JSON {format, version, tensors: [[name, dtype, shape, alias], ...]}."""
    return json.dumps({"format": HEADER_FORMAT, "version": int(version),
                       "tensors": [[n, d, [int(x) for x in s], a] for n, d, s, a in entries]},
                      separators=(",", ":")).encode()


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_header(raw: bytes) -> tuple[int, list[tuple[str, torch.dtype, tuple[int, ...], str | None]]]:
    """(version, [(name, dtype, shape, alias of an earlier name or None)]) of a header, checked."""
    def bad(what: str) -> BroadcastHeaderError:
        return BroadcastHeaderError(f"weight-broadcast header refused: {what}; expected the JSON header that "
                                    "rl_core.weights.broadcast.WeightBroadcaster sends (same rl_core version on "
                                    "both sides)")

    if len(raw) > MAX_HEADER_BYTES:
        raise bad(f"{len(raw)} bytes (limit {MAX_HEADER_BYTES})")
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"not UTF-8 JSON ({type(exc).__name__}: {str(exc)[:80]})") from None
    if not isinstance(data, dict) or data.get("format") != HEADER_FORMAT or set(data) != {"format", "version",
                                                                                         "tensors"}:
        got = f"keys {sorted(data)[:5]}" if isinstance(data, dict) else type(data).__name__
        raise bad(f"not a {HEADER_FORMAT} object ({got})")
    version, tensors = data["version"], data["tensors"]
    if type(version) is not int or version < 0:
        raise bad(f"version {version!r} is not a non-negative integer")
    if not isinstance(tensors, list):
        raise bad("tensors is not a list")
    out: list[tuple[str, torch.dtype, tuple[int, ...], str | None]] = []
    owned: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    seen: set[str] = set()
    for i, entry in enumerate(tensors):
        if not isinstance(entry, list) or len(entry) != 4:
            raise bad(f"tensor entry {i} is not [name, dtype, shape, alias]")
        name, dtype, shape, alias = entry
        if not isinstance(name, str) or not name or len(name) > 1000 or name in seen:
            raise bad(f"tensor entry {i} has name {name!r} (a unique non-empty string is expected)")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise bad(f"tensor {name!r} has dtype {str(dtype)[:40]!r} (known: {', '.join(DTYPES)})")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or any(type(x) is not int or x < 0 for x in shape)
                or math.prod(shape) > MAX_TENSOR_ELEMENTS):
            raise bad(f"tensor {name!r} has shape {str(shape)[:60]} (at most {MAX_DIMS} non-negative integers, "
                      f"at most {MAX_TENSOR_ELEMENTS} elements)")
        if alias is not None and (not isinstance(alias, str) or alias not in owned
                                  or owned[alias] != (DTYPES[dtype], tuple(shape))):
            raise bad(f"tensor {name!r} aliases {str(alias)[:60]!r}, which is not an earlier tensor of its dtype "
                      "and shape")
        seen.add(name)
        if alias is None:
            owned[name] = (DTYPES[dtype], tuple(shape))
        out.append((name, DTYPES[dtype], tuple(shape), alias))
    return version, out


@dataclass
class BroadcastGroup:
    """A process group of trainer rank 0 (rank 0) and the generation processes."""

    pg: Any
    store: Any
    rank: int
    world_size: int
    device: torch.device

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int, device: str = "cpu",
               timeout_s: float = 600.0) -> "BroadcastGroup":
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=True)
        dev = torch.device(device)
        if dev.type == "cuda":
            if dev.index is None:  # "cuda" (an engine's device): the current one, made explicit for NCCL
                dev = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(dev)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(dist.PrefixStore("rl_core/weights", store), rank, world_size, opts)
        else:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("rl_core/weights", store), rank, world_size, timeout)
        return cls(pg, store, rank, world_size, dev)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.pg.broadcast(tensor, 0).wait()


ALIGN = 16  # bytes: every tensor starts aligned in its bucket, so any dtype can view its slice


def _padded(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _as_bytes(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).to(dev)
    pad = _padded(raw.numel()) - raw.numel()
    return torch.nn.functional.pad(raw, (0, pad)) if pad else raw


class WeightBroadcaster:
    """The sending side (trainer rank 0 = group rank 0)."""

    kind = "broadcast"

    def __init__(self, group: BroadcastGroup, bucket_size_mb: float = 256.0):
        if group.rank != 0:
            raise ValueError("the broadcaster must be rank 0 of its group")
        self.group = group
        self.bucket_bytes = max(1, int(bucket_size_mb * 2**20))

    def send(self, version: int, weights: Mapping[str, torch.Tensor]) -> SyncReport:
        t0 = time.monotonic()
        dev = self.group.device
        owners: dict[tuple[int, int], str] = {}
        header: list[tuple[str, str, tuple[int, ...], str | None]] = []
        tensors: list[torch.Tensor] = []
        for name, t in weights.items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key in owners:  # tied: the receiver aliases it
                header.append((name, _dtype_name(t.dtype), tuple(t.shape), owners[key]))
                continue
            owners[key] = name
            header.append((name, _dtype_name(t.dtype), tuple(t.shape), None))
            tensors.append(t)
        blob = torch.frombuffer(bytearray(encode_header(version, header)), dtype=torch.uint8)
        self.group.broadcast(torch.tensor([blob.numel()], dtype=torch.int64, device=dev))
        self.group.broadcast(blob.to(dev))
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        sync()  # the header waits for every receiver: kept out of the bucket times below
        header_s = time.monotonic() - t0
        nbytes, buckets, pack_s, wire_s = 0, 0, 0.0, 0.0
        for bucket in broadcast_buckets([_padded(t.numel() * t.element_size()) for t in tensors], self.bucket_bytes):
            t1 = time.monotonic()
            flat = torch.cat([_as_bytes(tensors[i], dev) for i in bucket])  # host->device copies included
            sync()
            t2 = time.monotonic()
            self.group.broadcast(flat)
            sync()
            pack_s, wire_s = pack_s + t2 - t1, wire_s + time.monotonic() - t2
            nbytes += flat.numel()
            buckets += 1
        seconds = time.monotonic() - t0
        return SyncReport(self.kind, version, nbytes, seconds, {"send_s": seconds, "buckets": float(buckets),
                                                                  "header_s": header_s, "pack_s": pack_s,
                                                                  "broadcast_s": wire_s})


class WeightReceiver:
    """The receiving side (a generation process, group rank >= 1)."""

    kind = "broadcast"

    def __init__(self, group: BroadcastGroup, bucket_size_mb: float = 256.0):
        if group.rank == 0:
            raise ValueError("rank 0 of the group sends; receivers are ranks 1..")
        self.group = group
        self.bucket_bytes = max(1, int(bucket_size_mb * 2**20))

    def recv(self) -> tuple[int, dict[str, torch.Tensor], SyncReport]:
        """Block until rank 0 sends; returns (version, state dict on the group's device, report)."""
        t0 = time.monotonic()
        dev = self.group.device
        n = torch.zeros(1, dtype=torch.int64, device=dev)
        self.group.broadcast(n)
        size = int(n.item())
        if not 0 < size <= MAX_HEADER_BYTES:  # checked before allocating it
            raise BroadcastHeaderError(f"weight-broadcast header refused: announced length {size} bytes is outside "
                                       f"(0, {MAX_HEADER_BYTES}]; expected the header of "
                                       "rl_core.weights.broadcast.WeightBroadcaster")
        blob = torch.empty(size, dtype=torch.uint8, device=dev)
        self.group.broadcast(blob)
        version, header = parse_header(blob.cpu().numpy().tobytes())
        owned = [(name, dtype, shape) for name, dtype, shape, alias in header if alias is None]
        sizes = [torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size() for _, dt, shape in owned]
        state: dict[str, torch.Tensor] = {}
        nbytes = 0
        for bucket in broadcast_buckets([_padded(n) for n in sizes], self.bucket_bytes):
            flat = torch.empty(sum(_padded(sizes[i]) for i in bucket), dtype=torch.uint8, device=dev)
            self.group.broadcast(flat)
            nbytes += flat.numel()
            offset = 0
            for i in bucket:
                name, dt, shape = owned[i]
                state[name] = flat[offset:offset + sizes[i]].view(dt).reshape(shape)
                offset += _padded(sizes[i])
        for name, _, _, alias in header:
            if alias is not None:
                state[name] = state[alias]
        seconds = time.monotonic() - t0
        return version, state, SyncReport(self.kind, version, nbytes, seconds, {"recv_s": seconds})

    def receive_into(self, engine) -> SyncReport:
        """Receive one sync and load it with `engine.update_weights(version, state_dict)`."""
        version, state, report = self.recv()
        t0 = time.monotonic()
        engine.update_weights(version, state)
        load_s = time.monotonic() - t0
        report.parts["load_s"] = load_s
        report.seconds += load_s
        return report


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"weight {dtype} cannot be broadcast; supported dtypes: {', '.join(DTYPES)}")
    return name


def broadcast_buckets(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive indices grouped so each group's total is <= limit (a bigger item is alone)."""
    out: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, s in enumerate(sizes):
        if cur and total + s > limit:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += s
    if cur:
        out.append(cur)
    return out


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BroadcastWeightSync:
    """`trainer.weight_sync.type: broadcast`: the refit transport from trainer rank 0 to the
    `rl-core serve` servers of one `HttpBackend` (on this machine, or on the generation nodes).

    A push forms the group when there is none or its members changed (this process hosts the
    store on a free port, at the address the servers reach it by: the backend's
    `weight_group_host`; server i of the members joins as rank i + 1), then broadcasts the
    version while the servers receive and load it, and reports the sender's bytes and times
    plus the slowest server's receive and load seconds. The members are the servers that
    answer; one that died (its sync fails) is dropped and the push retried once without it;
    with none answering the version is deferred. A server that comes back behind (restarted
    from the initial weights, or down during a push) is caught up by the backend's health
    check through `catch_up`: a new group with it, and the newest version pushed, kept for
    that (the refit hands over a snapshot when the trainer's export is its live tensors)."""

    kind = "broadcast"
    keeps_latest = True  # rl_core.controller.refit: hand over weights this may keep until the next push

    @classmethod
    def from_recipe(cls, cfg, run_dir) -> "BroadcastWeightSync":
        """The registry's builder (`rl_core.weights.WEIGHT_SYNCS`): sends from trainer rank 0's
        device (set by init_distributed before this runs)."""
        ws = cfg.trainer.weight_sync
        cuda = cfg.runtime.device != "cpu" and torch.cuda.is_available()
        device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
        return cls(device, ws.bucket_size_mb, cfg.trainer.collective_timeout_s)

    def __init__(self, device: str, bucket_size_mb: float = 256.0, timeout_s: float = 600.0,
                 host: str | None = None):
        self.device = device
        self.sends_from_device = torch.device(device).type == "cuda"  # refit exports onto the GPU for it
        self.bucket_size_mb = bucket_size_mb
        self.timeout_s = timeout_s
        self.host = host  # None: the backend's weight_group_host
        self.sender: WeightBroadcaster | None = None
        self.members: list[tuple[int, int]] | None = None  # the group's servers: (endpoint id, its launches)
        self.latest: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self.groups_formed = 0
        self.retries = 0
        self._lock = None

    @staticmethod
    def _identity(members) -> list[tuple[int, int]]:
        return [(id(ep), ep.local.launches if ep.local is not None else 0) for ep in members]

    async def _form(self, backend, members) -> float:
        import asyncio

        t0 = time.monotonic()
        self.sender, self.members = None, None
        host = self.host or getattr(backend, "weight_group_host", "127.0.0.1")
        port = _free_port(host)
        group, _ = await asyncio.gather(
            asyncio.to_thread(BroadcastGroup.create, host, port, 0, len(members) + 1, self.device, self.timeout_s),
            backend.join_weight_broadcast(host, port, self.timeout_s, self.bucket_size_mb, members=members))
        self.sender, self.members = WeightBroadcaster(group, self.bucket_size_mb), self._identity(members)
        self.groups_formed += 1
        return time.monotonic() - t0

    async def _deliver(self, backend, version: int, weights: Mapping[str, torch.Tensor]) -> SyncReport | None:
        """One sync to the servers that answer now (None: there are none; the version waits)."""
        import asyncio

        members = backend.weight_group_members()
        group_init_s = 0.0
        if self.sender is None or self._identity(members) != self.members:
            await backend.fleet.check_all(catch_up=False)  # a new group: only servers that answer now
            members = backend.weight_group_members()
            if not members:
                backend.defer_weights(version)
                return None
            group_init_s = await self._form(backend, members)
        t1 = time.monotonic()
        recv = asyncio.ensure_future(backend.receive_weight_broadcast(version, self.timeout_s, members=members))
        send = asyncio.ensure_future(asyncio.to_thread(self.sender.send, version, weights))
        done, _ = await asyncio.wait({recv, send}, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:  # a failed side leaves the other blocked until the timeout
                for other in (recv, send):
                    other.cancel()
                self.sender, self.members = None, None  # the next sync forms a new group
                raise task.exception()
        report, answers = await send, await recv
        report.parts.update(group_init_s=group_init_s, recv_s=max(a["recv_s"] for a in answers),
                            load_s=max(a["load_s"] for a in answers), servers=float(len(members)))
        report.parts["deliver_s"] = time.monotonic() - t1  # sent, and every server received and loaded
        return report

    def _locked(self):
        import asyncio

        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def push(self, version: int, weights: Mapping[str, torch.Tensor], backends) -> SyncReport:
        import logging

        backends = list(backends)
        if len(backends) != 1 or not hasattr(backends[0], "receive_weight_broadcast"):
            raise ValueError("trainer.weight_sync.type 'broadcast' drives exactly one generation.backend 'http' "
                             f"(rl-core serve servers rl_core starts); got {[type(b).__name__ for b in backends]}")
        backend = backends[0]
        backend.broadcast_catch_up = self.catch_up
        self.latest = (version, weights)
        t0 = time.monotonic()
        async with self._locked():
            try:
                report = await self._deliver(backend, version, weights)
            except Exception as exc:  # noqa: BLE001 - a server died mid-sync: once more without it
                logging.getLogger(__name__).warning("weight broadcast of version %d failed (%s); checking the "
                                                    "servers and broadcasting again to those that answer",
                                                    version, exc)
                self.retries += 1
                await backend.fleet.check_all(catch_up=False)
                report = await self._deliver(backend, version, weights)
        if report is None:
            report = SyncReport(self.kind, version, 0, 0.0, {"deferred": 1.0})
        report.parts.update(groups_formed=float(self.groups_formed), retries=float(self.retries))
        report.seconds = time.monotonic() - t0
        return report

    async def catch_up(self, backend) -> None:
        """Bring the servers that answer to the newest version pushed (the backend's health check
        calls this for a server behind it)."""
        async with self._locked():
            if self.latest is None:
                return
            version, weights = self.latest
            if all(ep.version == version for ep in backend.weight_group_members()):
                return  # another caller did it
            await self._deliver(backend, version, weights)

