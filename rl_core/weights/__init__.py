"""Moving new weights from the trainer to generation (refit transports).

- `InProcessSync`: hand the state dict to in-process engines (the embedded default).
- `FilesystemWeightSync` (`filesystem.py`): a versioned safetensors directory per weight
  version plus a ready marker, older versions cleaned up; readers on any node with the
  shared file system load a version once its marker exists.
- `WeightBroadcaster` / `WeightReceiver` (`broadcast.py`): bucketed broadcast from trainer
  rank 0 to generation processes over a process group of their own (NCCL on GPU, gloo
  on CPU); the receiver loads into an engine with `update_weights(version, state_dict)`.
Each reports bytes and seconds (`SyncReport`). `make_weight_sync` picks from the recipe.
"""

from rl_core.weights.base import InProcessSync, SyncReport, make_weight_sync, state_dict_bytes
from rl_core.weights.broadcast import BroadcastGroup, BroadcastWeightSync, WeightBroadcaster, WeightReceiver
from rl_core.weights.filesystem import (FilesystemWeightSync, latest_ready_version, read_version, version_dir,
                                        wait_for_version)

__all__ = ["BroadcastGroup", "BroadcastWeightSync", "FilesystemWeightSync", "InProcessSync", "SyncReport", "WeightBroadcaster",
           "WeightReceiver", "latest_ready_version", "make_weight_sync", "read_version", "state_dict_bytes",
           "version_dir", "wait_for_version"]
