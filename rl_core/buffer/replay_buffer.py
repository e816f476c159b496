"""The replay buffer: one slot per prompt group, with its versions and payload.

Owns: slot life cycle `reserved -> ready -> selected | evicted | aborted`, the capacity
valve (reserved + ready slots never exceed `capacity`), waiting for capacity or for new
ready groups, moving a live slot to another target step (partial rollouts), per-state
counters, and the serialisable state of ready groups; the records of the slots the train
pump took (`TrainedGroup`: a slot with its advantages; `OpenStep`: an RL step open between
PPO mini-steps, built by the train pump and saved by the checkpoint, which both sit above).

Does not own: which groups may train (the sampler decides), generation, or scoring.
All methods run on the controller's event loop thread (no locking needed).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

import torch

from rl_core.types import PromptGroup, TrainChunk


class SlotState(str, enum.Enum):
    RESERVED = "reserved"
    READY = "ready"
    SELECTED = "selected"
    EVICTED = "evicted"
    ABORTED = "aborted"


LIVE = (SlotState.RESERVED, SlotState.READY)
# the states' names as `counts` keys, read once (an enum member's `.value` is a descriptor call)
_RESERVED, _READY = SlotState.RESERVED.value, SlotState.READY.value


@dataclass
class Slot:
    group_id: str
    dispatch_index: int  # global order of dispatch (0, 1, 2, ...)
    prompt_index: int
    epoch: int
    start_version: int
    target_step: int | None
    state: SlotState = SlotState.RESERVED
    end_version: int | None = None
    group: PromptGroup | None = None
    reserved_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    carried: int = 0  # times its target step was moved to a later step (partial rollouts)
    selected_at: float | None = None  # when the train pump took it (trajectory age = selected_at - ready_at)


@dataclass
class TrainedGroup:
    """A prompt group the train pump took for an RL step, with its advantages."""

    slot: Slot  # its buffer slot
    group: PromptGroup
    advantages: list[float]
    staleness: int  # trainer version at train time - weight version at dispatch


@dataclass
class OpenStep:
    """An RL step interrupted between two of its PPO mini-steps: what the train pump needs to
    continue it at `next_ministep` (after a checkpoint between mini-steps, or a failure once
    some mini-steps had updated the policy). Built by the train pump, written and read back by
    rl_core.checkpoint.run_state, handed back to the train pump on resume."""

    step: int  # the RL step
    next_ministep: int  # index of the first mini-step not yet done (epoch * num_minibatches + j)
    trained: list[TrainedGroup]  # the step's groups, in training order
    chunk: TrainChunk  # the step's whole batch (previous-policy logprobs included when computed)
    served_weights: dict[str, torch.Tensor] | None = None  # the step's starting weights (generation serves them)
    metric_sums: dict[str, float] = field(default_factory=dict)  # the finished mini-steps' metric sums
    metric_counts: dict[str, int] = field(default_factory=dict)  # and how many mini-steps reported each


def _by_dispatch(slot: Slot) -> int:
    return slot.dispatch_index


class ReplayBuffer:
    def __init__(self, capacity: int, changed: asyncio.Condition | None = None):
        self.capacity = capacity
        self._slots: dict[str, Slot] = {}  # live slots only (terminal ones are dropped at once)
        # per-state indexes, so the valves and the samplers' queries cost O(1) / O(ready) and
        # not O(all slots) at every wake-up of every waiter (quadratic in groups per step)
        self._ready: dict[str, Slot] = {}
        self._reserved: dict[str, Slot] = {}
        self._ready_by_target: dict[int | None, dict[str, Slot]] = {}  # stamped samplers select by target step
        # shared with the rest of the controller so one wait can cover several conditions
        self._changed = changed or asyncio.Condition()
        self.counts = {s.value: 0 for s in SlotState}  # terminal/lifetime counters

    @property
    def changed(self) -> asyncio.Condition:
        """The condition every transition notifies (the controller's shared one where given)."""
        return self._changed

    # ------------------------------------------------------------------ queries

    def live(self) -> int:
        return len(self._slots)  # every slot held is reserved or ready

    def num_ready(self) -> int:
        return len(self._ready)

    def ready(self) -> list[Slot]:
        """Ready slots in dispatch order."""
        return sorted(self._ready.values(), key=_by_dispatch)

    def ready_for_target(self, target_step: int | None) -> list[Slot]:
        """Ready slots stamped for `target_step`, in dispatch order (O(those slots))."""
        return sorted(self._ready_by_target.get(target_step, {}).values(), key=_by_dispatch)

    def ready_targets(self) -> list[int | None]:
        """The target steps that have ready slots."""
        return list(self._ready_by_target)

    def reserved_for_target(self, target_step: int | None) -> list[Slot]:
        """Reserved (still generating) slots stamped for `target_step`, in dispatch order."""
        return sorted((s for s in self._reserved.values() if s.target_step == target_step), key=_by_dispatch)

    def reserved(self) -> list[Slot]:
        """Reserved (still generating) slots in dispatch order."""
        return sorted(self._reserved.values(), key=_by_dispatch)

    def get(self, group_id: str) -> Slot:
        return self._slots[group_id]

    def find(self, group_id: str) -> Slot | None:
        """The live slot of `group_id`, or None when it holds none (never reserved, or finished)."""
        return self._slots.get(group_id)

    def has_capacity(self) -> bool:
        return self.live() < self.capacity

    # ------------------------------------------------------------------ waiting

    async def wait_for(self, predicate, timeout: float | None = None) -> bool:
        """Wait until predicate() is true (re-checked at every buffer change)."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(predicate), timeout)
                return True
            except asyncio.TimeoutError:
                return False

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------------ transitions

    def reserve(self, group_id: str, dispatch_index: int, prompt_index: int, epoch: int, start_version: int,
                target_step: int | None, force: bool = False) -> Slot:
        """`force`: a refill of the step in training (dynamic sampling) may exceed capacity briefly."""
        if not force and not self.has_capacity():
            raise RuntimeError("reserve() without capacity; wait for has_capacity() first")
        slot = Slot(group_id, dispatch_index, prompt_index, epoch, start_version, target_step)
        self._drop_index(group_id)
        self._slots[group_id] = slot
        self._reserved[group_id] = slot
        self.counts[_RESERVED] += 1
        return slot

    async def commit(self, group_id: str, group: PromptGroup) -> Slot:
        slot = self._slots[group_id]
        assert slot.state == SlotState.RESERVED, slot.state
        slot.group = group
        slot.end_version = group.end_version
        slot.state = SlotState.READY
        slot.ready_at = time.monotonic()
        del self._reserved[group_id]
        self._index_ready(slot)
        self.counts[_READY] += 1
        await self.notify()
        return slot

    def restamp(self, group_id: str, target_step: int) -> Slot:
        """Move a live slot (and its group, when ready) to another target step (partial rollouts:
        a straggler and a ready group of a later step swap their steps)."""
        slot = self._slots[group_id]
        if slot.state == SlotState.READY:
            self._drop_index(group_id)
            slot.target_step = target_step
            slot.group.target_step = target_step
            self._index_ready(slot)
        else:
            slot.target_step = target_step
        return slot

    async def finish(self, slots: list[Slot], state: SlotState) -> None:
        """Move slots to a terminal state (selected / evicted / aborted); frees capacity."""
        key = state.value
        for slot in slots:
            assert slot.state in LIVE, (slot.group_id, slot.state)
            slot.state = state
            self.counts[key] += 1
            if state == SlotState.SELECTED:
                slot.selected_at = time.monotonic()
            else:
                slot.group = None
            del self._slots[slot.group_id]
            self._drop_index(slot.group_id)
        await self.notify()

    async def restore_ready(self, slots: list[Slot]) -> None:
        """Return selected slots (of an RL step that failed) to the buffer as ready; may exceed capacity."""
        for slot in slots:
            assert slot.state == SlotState.SELECTED and slot.group is not None, (slot.group_id, slot.state)
            slot.state = SlotState.READY
            slot.selected_at = None
            self._slots[slot.group_id] = slot
            self._index_ready(slot)
        await self.notify()

    def _index_ready(self, slot: Slot) -> None:
        self._ready[slot.group_id] = slot
        self._ready_by_target.setdefault(slot.target_step, {})[slot.group_id] = slot

    def _drop_index(self, group_id: str) -> None:
        slot = self._ready.pop(group_id, None)
        if slot is not None:
            same = self._ready_by_target[slot.target_step]
            del same[group_id]
            if not same:
                del self._ready_by_target[slot.target_step]
        self._reserved.pop(group_id, None)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Ready groups with their payloads (in-flight slots are not saved: the controller drains them first)."""
        return {
            "capacity": self.capacity,
            "counts": dict(self.counts),
            "ready": [
                {"group_id": s.group_id, "dispatch_index": s.dispatch_index, "prompt_index": s.prompt_index,
                 "epoch": s.epoch, "start_version": s.start_version, "end_version": s.end_version,
                 "target_step": s.target_step, "carried": s.carried, "group": s.group}
                for s in self.ready()
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        self._slots.clear()
        self._ready.clear()
        self._reserved.clear()
        self._ready_by_target.clear()
        self.counts = dict(state["counts"])
        for r in state["ready"]:
            slot = Slot(r["group_id"], r["dispatch_index"], r["prompt_index"], r["epoch"], r["start_version"],
                        r["target_step"], SlotState.READY, r["end_version"], r["group"],
                        carried=int(r.get("carried", 0)))  # absent in checkpoints before partial rollouts kept it
            self._slots[slot.group_id] = slot
            self._index_ready(slot)
