"""What an `rl-core serve` process and its clients agree on, below both of them.

Owns: the control-secret header of the managed `/rl/*` routes and the environment variable
that carries the secret by default, the most choices one request may ask for (`MAX_N`), and
`check_safetensors_file` (the check a server makes before loading a safetensors file: at
start-up and on every weight-version load).

Does not own: the command and its option checks (rl_core.launch.serve), the routes
(rl_core.serve.app) or the clients (rl_core.generation.http.backend / rl_core.generation.http.fleet). This
module is a leaf (standard library only) so that the routes and the clients need not import
the launch layer.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

DEFAULT_CONTROL_SECRET_ENV = "RL_CORE_CONTROL_SECRET"
CONTROL_SECRET_HEADER = "X-RL-Core-Secret"
MAX_N = 128  # choices per prompt of one request (rl_core.serve.protocol refuses more)


def check_safetensors_file(path: Path) -> None:
    """Raise ValueError unless `path` is a complete safetensors file: an 8-byte header length,
    a JSON header of tensor entries, and every tensor's data inside the file (read: the
    header only)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} holds {size} bytes: too short for a safetensors file (truncated or empty)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 * 2**20):
            raise ValueError(f"{path} is not a complete safetensors file: its header announces {n} bytes, the file "
                             f"has {size} (truncated, or not safetensors)")
        try:
            header = json.loads(fh.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise ValueError(f"{path} is not a safetensors file: its header is not JSON (garbage or another "
                             "format)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not a JSON object")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
            raise ValueError(f"{path} is not a valid safetensors file: tensor {name!r} has no valid data_offsets")
        end = max(end, offsets[1])
    if 8 + n + end > size:
        raise ValueError(f"{path} is truncated: its tensors need {8 + n + end} bytes, the file has {size}")
