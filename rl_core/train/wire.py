"""Wire format of the trainer command channel (`rl_core.train.spmd`): no pickle.

Owns: turning a command `(name, args, kwargs)` into bytes for the process group's key-value
store and back (`dumps`, whose docstring gives the layout, and `loads`). The store (a
`torch.distributed.TCPStore`) listens on a TCP port any local process can reach, so what a
worker reads must never run code: values travel as JSON, tensors as safetensors, and only an
explicit list of types is rebuilt (recipe sections under `rl_core.config`, revalidated, and
the codecs of `CODECS`). Anything else is refused when sent (`WireError` naming the type: add
a codec here) and when received (an unknown tag or a class outside the allowed set).

Does not own: the command protocol (spmd.py) or what the commands do (the trainers).

Read more: docs/distributed-training.md, "How the processes work together".
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import struct
from pathlib import Path, PurePath
from typing import Any, Callable

import torch

MAGIC = b"RLCWIRE1"
SECTION_PACKAGE = "rl_core.config."


class WireError(ValueError):
    """A value that cannot be sent through, or a message that cannot be read from, the channel."""


@dataclasses.dataclass(frozen=True)
class Codec:
    cls: Callable[[], type]  # resolved lazily: importing the trainers' types here would be circular
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


def _loss_cls():
    from rl_core.algorithms.losses import PolicyGradientLoss

    return PolicyGradientLoss


def _chunk_cls():
    from rl_core.types import TrainChunk

    return TrainChunk


def _decode_loss(data: Any):
    from rl_core.config.schema import LossConfig

    if not isinstance(data, dict) or set(data) != {"cfg", "multi_update"} or not isinstance(data["cfg"], LossConfig):
        raise WireError("policy loss: expected {cfg: LossConfig, multi_update: bool}")
    return _loss_cls()(data["cfg"], multi_update=bool(data["multi_update"]))


def _decode_chunk(data: Any):
    cls = _chunk_cls()
    names = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(data, dict) or not set(data) <= names or any(
            v is not None and not isinstance(v, torch.Tensor) for v in data.values()):
        raise WireError("TrainChunk: expected its fields as tensors (or null)")
    return cls(**data)


CODECS: dict[str, Codec] = {
    "policy_gradient_loss": Codec(_loss_cls, lambda x: {"cfg": x.cfg, "multi_update": bool(x.needs_prev_logprobs)},
                                  _decode_loss),
    "train_chunk": Codec(_chunk_cls, lambda x: {f.name: getattr(x, f.name) for f in dataclasses.fields(x)},
                         _decode_chunk),
}


# ---------------------------------------------------------------------- encoding


def dumps(obj: Any) -> bytes:
    """The message's bytes; `WireError` for a value of another type.

    Layout: `MAGIC` (8 bytes), the JSON part's length (8 bytes, little endian), the JSON part
    (UTF-8), then a safetensors blob of every tensor of the message (`t0`, `t1`, ...; empty when
    none). Plain JSON values are themselves; every other value is an object with one tag key:
    `{"$dict": {...}}` (string keys), `{"$tuple": [...]}`, `{"$path": "..."}`, `{"$tensor": "t3"}`
    (sent from CPU, contiguous), `{"$section": "rl_core.config.<module>:<Class>", "data": ...}` (a
    recipe section, validated again with `model_validate` on the worker) and `{"$obj": "<codec>",
    "data": ...}` (a registered codec of `CODECS`: the policy loss, `TrainChunk`)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(obj, tensors, 0)
    head = json.dumps(tree, separators=(",", ":")).encode()
    blob = save(tensors) if tensors else b""
    return MAGIC + struct.pack("<Q", len(head)) + head + blob


def _encode(x: Any, tensors: dict[str, torch.Tensor], depth: int) -> Any:
    if depth > 64:
        raise WireError("value nested more than 64 levels deep")
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [_encode(v, tensors, depth + 1) for v in x]
    if isinstance(x, tuple):
        return {"$tuple": [_encode(v, tensors, depth + 1) for v in x]}
    if isinstance(x, dict):
        if not all(isinstance(k, str) for k in x):
            raise WireError(f"dict keys must be strings; got {[type(k).__name__ for k in x][:3]}")
        return {"$dict": {k: _encode(v, tensors, depth + 1) for k, v in x.items()}}
    if isinstance(x, PurePath):
        return {"$path": str(x)}
    if isinstance(x, torch.Tensor):
        key = f"t{len(tensors)}"
        # own storage, contiguous, on CPU: safetensors refuses shared or strided tensors
        tensors[key] = x.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        return {"$tensor": key}
    from rl_core.config.base import Section

    if isinstance(x, Section):
        cls = type(x)
        if not cls.__module__.startswith(SECTION_PACKAGE):
            raise WireError(f"recipe section {cls.__qualname__} is not defined under {SECTION_PACKAGE}")
        return {"$section": f"{cls.__module__}:{cls.__qualname__}", "data": x.model_dump(mode="json")}
    for name, codec in CODECS.items():
        if type(x) is codec.cls():
            return {"$obj": name, "data": _encode(codec.encode(x), tensors, depth + 1)}
    raise WireError(f"a {type(x).__module__}.{type(x).__qualname__} cannot travel through the trainer command "
                    "channel (JSON values, tensors, recipe sections and the codecs of rl_core.train.wire only); "
                    "add a codec in rl_core/train/wire.py")


# ---------------------------------------------------------------------- decoding


def loads(data: bytes) -> Any:
    """The value of a message made by `dumps`; `WireError` for anything else."""
    if not isinstance(data, (bytes, bytearray)) or data[:len(MAGIC)] != MAGIC or len(data) < len(MAGIC) + 8:
        raise WireError("not an rl_core.train.wire message (bad magic); the store holds something rl_core did not "
                        "write there")
    (n,) = struct.unpack("<Q", data[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if n > len(data) - start:
        raise WireError(f"truncated message: its JSON part announces {n} bytes, {len(data) - start} follow")
    try:
        tree = json.loads(bytes(data[start:start + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"the JSON part does not parse ({type(exc).__name__})") from None
    blob = bytes(data[start + n:])
    tensors: dict[str, torch.Tensor] = {}
    if blob:
        from safetensors.torch import load

        try:
            tensors = load(blob)
        except Exception as exc:  # noqa: BLE001 - safetensors' own error type: refused either way
            raise WireError(f"the tensor part is not a safetensors blob ({exc})") from None
    return _decode(tree, tensors, 0)


def _decode(x: Any, tensors: dict[str, torch.Tensor], depth: int) -> Any:
    if depth > 64:
        raise WireError("message nested more than 64 levels deep")
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [_decode(v, tensors, depth + 1) for v in x]
    if not isinstance(x, dict) or len(x) not in (1, 2):
        raise WireError(f"unexpected JSON object with keys {sorted(x)[:4] if isinstance(x, dict) else x!r}")
    if set(x) == {"$tuple"} and isinstance(x["$tuple"], list):
        return tuple(_decode(v, tensors, depth + 1) for v in x["$tuple"])
    if set(x) == {"$dict"} and isinstance(x["$dict"], dict):
        return {k: _decode(v, tensors, depth + 1) for k, v in x["$dict"].items()}
    if set(x) == {"$path"} and isinstance(x["$path"], str):
        return Path(x["$path"])
    if set(x) == {"$tensor"}:
        if x["$tensor"] not in tensors:
            raise WireError(f"tensor {str(x['$tensor'])[:20]!r} is not in the message")
        return tensors[x["$tensor"]]
    if set(x) == {"$section", "data"} and isinstance(x["$section"], str):
        return _section(x["$section"], x["data"])
    if set(x) == {"$obj", "data"} and x["$obj"] in CODECS:
        return CODECS[x["$obj"]].decode(_decode(x["data"], tensors, depth + 1))
    raise WireError(f"unknown tag in {json.dumps(x)[:80]} (known: $dict, $tuple, $path, $tensor, $section, "
                    f"$obj of {sorted(CODECS)})")


def _section(ref: str, data: Any):
    from rl_core.config.base import Section

    module, _, qualname = ref.partition(":")
    if (not module.startswith(SECTION_PACKAGE) or not qualname.isidentifier()
            or not all(part.isidentifier() for part in module.split("."))):
        raise WireError(f"recipe section {ref[:80]!r} is not a class of a module under {SECTION_PACKAGE}")
    try:
        cls = getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError):
        raise WireError(f"recipe section {ref[:80]!r} does not exist in this rl_core") from None
    if not (isinstance(cls, type) and issubclass(cls, Section)):
        raise WireError(f"{ref[:80]!r} is not a recipe section")
    return cls.model_validate(data)
