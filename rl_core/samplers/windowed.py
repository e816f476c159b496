"""The `windowed` sampler: any ready group inside the staleness window.

Owns: selection of any ready group with trainer_version - start_version <= S
(`max_staleness_versions`), in dispatch order or freshest first; eviction of ready groups
that aged out of the window (their generation is wasted, and counted); and the decision
to abort in-flight groups that a refit pushed out of the window, so the engine is freed
at once. It has no admission gate: dispatch is bounded by buffer capacity, the in-flight
caps and `async_rl.over_sampling_ratio`.

Does not own: waiting, the buffer, the abort itself (the rollout pump aborts).
"""

from __future__ import annotations

from rl_core.buffer.replay_buffer import ReplayBuffer, Slot
from rl_core.samplers.base import BaseSampler, in_window


class WindowedSampler(BaseSampler):
    name = "windowed"

    def __init__(self, cfg, num_prompts_per_step: int):
        super().__init__(num_prompts_per_step, None)
        self.max_staleness = cfg.max_staleness_versions
        self.freshest_first = cfg.sample_freshest_first

    @property
    def staleness_bound(self) -> int:
        return self.max_staleness

    def select(self, buffer: ReplayBuffer, trainer_version: int, max_groups: int) -> list[Slot]:
        ok = [s for s in buffer.ready() if in_window(s, trainer_version, self.max_staleness)]
        if self.freshest_first:
            ok.sort(key=lambda s: (-s.start_version, s.dispatch_index))
        return ok[:max_groups]

    def evict(self, buffer: ReplayBuffer, trainer_version: int) -> list[Slot]:
        return [s for s in buffer.ready() if not in_window(s, trainer_version, self.max_staleness)]

    def should_abort_inflight(self, slot: Slot, trainer_version: int) -> bool:
        return not in_window(slot, trainer_version, self.max_staleness)
