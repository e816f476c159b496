"""The sampler protocol and the shared machinery of the built-in samplers.

Owns: the `Sampler` protocol every sampler (built-in or `custom`) satisfies, the dispatch
counter with its notion of a "batch" (every `num_prompts_per_step` dispatched groups), the
admission gate shared by the gated samplers, and version-window helpers.

A sampler decides, for the controller: whether the rollout pump may dispatch now
(`can_admit` / `admit`, which may stamp a target step), which ready groups train now
(`select`), which ready groups can never train and must go (`evict`), which in-flight
groups are already too old to be worth finishing (`should_abort_inflight`), and, with partial
rollouts, which straggler trades its step with a ready later group (`carry_over`); and what
the controller sizes from it (`lookahead`, `required_capacity`). It owns its staleness rule and
its `state_dict`. Does not own: waiting (the pumps wait on it), the buffer, or the trainer.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rl_core.buffer.replay_buffer import ReplayBuffer, Slot


@runtime_checkable
class Sampler(Protocol):
    name: str
    stamps: bool  # True: admit() returns a target step and select() trains exactly that step's groups
    staleness_bound: int | None  # largest trainer_version - start_version of a trained group (None = unbounded)
    window: int | None  # admission gate: batch b dispatches once trainer_version >= b - window (None: no gate)
    carry_bound: int | None  # partial rollouts: largest staleness of a carried group (None: carry_over never pairs)
    lookahead: int
    """Stamped samplers: the largest number of steps dispatch can ever run ahead of the trainer
    (a group for step s is dispatched at weight version >= s - lookahead): the controller's
    dispatch limit (`stop_step + lookahead`) and the reach of the reproducible refit barrier
    come from it. 0 for samplers that do not stamp (their dispatch follows the trainer's demand)."""

    def lookahead_at(self, version: int) -> int | None:
        """The staleness bound that applies while the trainer holds `version` (the admission
        window the rollout pump reports; fixed samplers: `staleness_bound`)."""

    def observe(self, step: int, metrics: dict) -> dict[str, float]:
        """Called once per finished RL step with its metrics; returns extra metrics to log
        (an adaptive bound decides the bound of later versions here)."""

    def next_target_step(self) -> int: ...
    def can_admit(self, trainer_version: int) -> bool: ...
    def admit(self, trainer_version: int) -> int | None: ...
    def select(self, buffer: ReplayBuffer, trainer_version: int, max_groups: int) -> list[Slot]: ...
    def evict(self, buffer: ReplayBuffer, trainer_version: int) -> list[Slot]: ...
    def should_abort_inflight(self, slot: Slot, trainer_version: int) -> bool: ...
    def required_capacity(self) -> int:
        """Buffer slots the sampler needs so that the pumps cannot deadlock; the controller refuses
        a smaller `async_rl.max_buffered_groups` (built-in samplers: checked at recipe load)."""

    def carry_over(self, buffer: ReplayBuffer, step: int, need: int) -> list[tuple[Slot, Slot]]:
        """Partial rollouts (stamped samplers): pairs (straggler of `step` still generating, ready
        group of a later step) whose target steps the train pump swaps so that step `step` need not
        wait for the straggler; `need` is how many groups the step still waits for. Samplers that
        never carry return [] (and have `carry_bound` None)."""

    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class BaseSampler:
    """Dispatch counting, the batch gate, and state; subclasses define select/evict/abort."""

    name = "base"
    stamps = False
    window: int | None = None  # set per instance in __init__ (declared here so the class has every member)
    carry_bound: int | None = None  # partial rollouts off: carry_over pairs nothing

    def __init__(self, num_prompts_per_step: int, window: int | None):
        self.groups_per_step = num_prompts_per_step
        self.window = window  # gate: batch b may dispatch once trainer_version >= b - window (None: no gate)
        self.dispatched = 0

    @classmethod
    def from_recipe(cls, cfg) -> "BaseSampler":
        """The registry's builder (`rl_core.samplers.SAMPLERS`) for built-in samplers, which are
        constructed as `cls(async_rl.sampler section, num_prompts_per_step)`."""
        return cls(cfg.async_rl.sampler, cfg.grpo.num_prompts_per_step)

    @property
    def staleness_bound(self) -> int | None:
        return self.window

    @property
    def lookahead(self) -> int:
        """See `Sampler.lookahead`: the staleness bound of a stamped sampler, else 0."""
        return (self.staleness_bound or 0) if self.stamps else 0

    def lookahead_at(self, version: int) -> int | None:
        return self.staleness_bound

    def observe(self, step: int, metrics: dict) -> dict[str, float]:
        return {}

    def next_target_step(self) -> int:
        """The notional step (batch) of the next dispatched group: dispatched // groups_per_step."""
        return self.dispatched // self.groups_per_step

    def can_admit(self, trainer_version: int) -> bool:
        return self.window is None or self.next_target_step() <= trainer_version + self.window

    def admit(self, trainer_version: int) -> int | None:
        if not self.can_admit(trainer_version):
            raise RuntimeError(f"admit() called while the {self.name} gate is closed")
        step = self.next_target_step()
        self.dispatched += 1
        return step if self.stamps else None

    def evict(self, buffer: ReplayBuffer, trainer_version: int) -> list[Slot]:
        return []

    def should_abort_inflight(self, slot: Slot, trainer_version: int) -> bool:
        return False

    def carry_over(self, buffer: ReplayBuffer, step: int, need: int) -> list[tuple[Slot, Slot]]:
        """Partial rollouts (see `Sampler.carry_over`): none by default."""
        return []

    def required_capacity(self) -> int:
        return self.groups_per_step

    def state_dict(self) -> dict:
        return {"name": self.name, "dispatched": self.dispatched}

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"sampler state is for {state.get('name')!r}, not {self.name!r}; "
                             "a run must resume with the sampler it was checkpointed with")
        self.dispatched = int(state["dispatched"])


def in_window(slot: Slot, trainer_version: int, staleness: int) -> bool:
    return trainer_version - slot.start_version <= staleness
