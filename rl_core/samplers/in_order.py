"""The `in_order` sampler: step s trains exactly the groups dispatched for step s.

Owns: stamping each dispatched group with its target step (dispatch order, one step =
`num_prompts_per_step` groups), the admission gate (dispatch for step s opens once the
trainer holds weight version s - max_lookahead_versions), selection (ready groups of the
current step), and its resumable state. Because a group for step s is dispatched at a
version >= s - L and trained at version s, its staleness (trainer version - start version)
is at most L = `max_lookahead_versions`; L = 0 is synchronous RL.

Does not own: the buffer (it only reads slots), waiting (the pumps wait on its answers).
"""

from __future__ import annotations

from rl_core.buffer.replay_buffer import Slot
from rl_core.config.schema import InOrderSamplerConfig


class InOrderSampler:
    name = "in_order"

    def __init__(self, cfg: InOrderSamplerConfig, num_prompts_per_step: int):
        self.lookahead = cfg.max_lookahead_versions
        self.groups_per_step = num_prompts_per_step
        self.dispatched = 0  # groups stamped so far (the next one gets dispatched // groups_per_step)

    @property
    def staleness_bound(self) -> int:
        return self.lookahead

    def next_target_step(self) -> int:
        return self.dispatched // self.groups_per_step

    def can_admit(self, trainer_version: int) -> bool:
        return self.next_target_step() <= trainer_version + self.lookahead

    def admit(self, trainer_version: int) -> int:
        """Stamp the next dispatched group; only call when can_admit() is true."""
        if not self.can_admit(trainer_version):
            raise RuntimeError("admit() called while the in_order gate is closed")
        step = self.next_target_step()
        self.dispatched += 1
        return step

    def select(self, ready: list[Slot], trainer_version: int, max_groups: int) -> list[Slot]:
        return [s for s in ready if s.target_step == trainer_version][:max_groups]

    def evict(self, ready: list[Slot], trainer_version: int) -> list[Slot]:
        return []  # stamped groups can never exceed the bound, nothing to evict

    def should_abort_inflight(self, slot: Slot, trainer_version: int) -> bool:
        return False

    def required_capacity(self) -> int:
        return self.groups_per_step

    def state_dict(self) -> dict:
        return {"name": self.name, "dispatched": self.dispatched}

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"sampler state is for {state.get('name')!r}, not {self.name!r}")
        self.dispatched = int(state["dispatched"])
