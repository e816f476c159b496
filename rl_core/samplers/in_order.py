"""The `in_order` sampler: step s trains exactly the groups dispatched for step s.

Owns: stamping each dispatched group with its target step (dispatch order, one step =
`num_prompts_per_step` groups), the admission gate (dispatch for step s opens once the
trainer holds weight version s - max_lookahead_versions), and selection (ready groups of
the current step). A group for step s is dispatched at a version >= s - L and trained at
version s, so its staleness is at most L = `max_lookahead_versions`; L = 0 is synchronous.

Does not own: the buffer (it only reads slots), waiting (the pumps wait on its answers).
"""

from __future__ import annotations

from rl_core.buffer.replay_buffer import ReplayBuffer, Slot
from rl_core.samplers.base import BaseSampler


class InOrderSampler(BaseSampler):
    name = "in_order"
    stamps = True

    def __init__(self, cfg, num_prompts_per_step: int, reproducible: bool = False):
        super().__init__(num_prompts_per_step, cfg.max_lookahead_versions)
        self.lookahead = cfg.max_lookahead_versions
        self.reproducible = reproducible

    def select(self, buffer: ReplayBuffer, trainer_version: int, max_groups: int) -> list[Slot]:
        return buffer.ready_for_target(trainer_version)[:max_groups]

    def evict(self, buffer: ReplayBuffer, trainer_version: int) -> list[Slot]:
        # a group stamped for a step that already trained (e.g. restored from an older checkpoint)
        old = [t for t in buffer.ready_targets() if t is not None and t < trainer_version]
        if not old:  # the common case, O(1) at every wake-up of the train pump
            return []
        return sorted((s for t in old for s in buffer.ready_for_target(t)), key=lambda s: s.dispatch_index)

    def required_capacity(self) -> int:
        # a reproducible refit barrier holds every group of the next `lookahead` steps, plus the current one
        return self.groups_per_step * ((self.lookahead + 1) if self.reproducible else 1)
