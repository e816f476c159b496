"""The `ready_first` sampler: any ready group, mixed versions, in dispatch order; never evicts.

Owns: its gate (batch b dispatches once trainer_version >= b - max_staleness_versions,
which bounds how far generation runs ahead) and selection of any ready group. Nothing is
discarded: a straggler stays selectable however old it gets, so the staleness of a
trained group is not bounded; the loss must correct for it with importance sampling
(the recipe is rejected otherwise).

Does not own: waiting, the buffer.
"""

from __future__ import annotations

from rl_core.buffer.replay_buffer import ReplayBuffer, Slot
from rl_core.samplers.base import BaseSampler


class ReadyFirstSampler(BaseSampler):
    name = "ready_first"

    def __init__(self, cfg, num_prompts_per_step: int):
        super().__init__(num_prompts_per_step, cfg.max_staleness_versions)

    @property
    def staleness_bound(self) -> None:
        return None  # stragglers are kept and trained whenever they arrive

    def select(self, buffer: ReplayBuffer, trainer_version: int, max_groups: int) -> list[Slot]:
        return [s for s in buffer.ready() if s.start_version <= trainer_version][:max_groups]
