"""The `weight_fifo` sampler: oldest weight version first, within a staleness window.

Owns: its gate (batch b dispatches once trainer_version >= b - max_staleness_versions),
selection (among the weight versions of live groups inside the window — ready or still
generating — take the oldest and return its ready groups: strict FIFO by version, so it
waits for the stragglers of the oldest version), and eviction of ready groups that fell
out of the window (trainer_version - start_version > max_staleness_versions).

Does not own: waiting, the buffer.
"""

from __future__ import annotations

from rl_core.buffer.replay_buffer import ReplayBuffer, Slot
from rl_core.samplers.base import BaseSampler, in_window


class WeightFifoSampler(BaseSampler):
    name = "weight_fifo"

    def __init__(self, cfg, num_prompts_per_step: int):
        super().__init__(num_prompts_per_step, cfg.max_staleness_versions)
        self.max_staleness = cfg.max_staleness_versions

    def select(self, buffer: ReplayBuffer, trainer_version: int, max_groups: int) -> list[Slot]:
        live = [s for s in buffer.ready() + buffer.reserved() if in_window(s, trainer_version, self.max_staleness)]
        if not live:
            return []
        oldest = min(s.start_version for s in live)
        return [s for s in buffer.ready() if s.start_version == oldest][:max_groups]

    def evict(self, buffer: ReplayBuffer, trainer_version: int) -> list[Slot]:
        return [s for s in buffer.ready() if not in_window(s, trainer_version, self.max_staleness)]
