"""Moving new weights from the trainer to generation (refit transports), and their registry.

`WEIGHT_SYNCS` maps the recipe's `trainer.weight_sync.type` to a transport class (each has
`from_recipe(recipe, run_dir)`; the contract is `rl_core.protocols.WeightSync`), one module each:
- `in_process` (`InProcessSync`): hand the state dict to in-process engines (the embedded default).
- `filesystem` (`FilesystemWeightSync`): a versioned safetensors directory per weight
  version plus a ready marker, older versions cleaned up; readers on any node with the
  shared file system load a version once its marker exists.
- `broadcast` (`BroadcastWeightSync`, over `WeightBroadcaster` / `WeightReceiver`): bucketed
  broadcast from trainer rank 0 to generation processes over a process group of their own
  (NCCL on GPU, gloo on CPU); the receiver loads into an engine with `update_weights(version, state_dict)`.
Each reports bytes and seconds (`SyncReport`). `make_weight_sync` builds the recipe's one.
"""

from __future__ import annotations

from pathlib import Path

from rl_core.protocols import WeightSync
from rl_core.types import SyncReport
from rl_core.weights.base import snapshot, state_dict_bytes
from rl_core.weights.broadcast import BroadcastGroup, BroadcastWeightSync, WeightBroadcaster, WeightReceiver
from rl_core.weights.filesystem import (FilesystemWeightSync, latest_ready_version, read_version, version_dir,
                                        wait_for_version)
from rl_core.weights.in_process import InProcessSync

WEIGHT_SYNCS: dict[str, type] = {
    "in_process": InProcessSync,
    "filesystem": FilesystemWeightSync,
    "broadcast": BroadcastWeightSync,
}


def make_weight_sync(cfg, run_dir: str | Path) -> WeightSync:
    """The recipe's weight transport (`trainer.weight_sync`)."""
    ws = cfg.trainer.weight_sync
    cls = WEIGHT_SYNCS.get(ws.type)
    if cls is None:
        raise ValueError(f"unknown trainer.weight_sync.type {ws.type!r}")
    return cls.from_recipe(cfg, run_dir)


__all__ = ["BroadcastGroup", "BroadcastWeightSync", "FilesystemWeightSync", "InProcessSync", "SyncReport",
           "WEIGHT_SYNCS", "WeightBroadcaster", "WeightReceiver", "latest_ready_version", "make_weight_sync",
           "read_version", "snapshot", "state_dict_bytes", "version_dir", "wait_for_version"]
