"""The rollout pump: prompts -> generation -> environment -> replay buffer.

Owns: drawing prompt batches from the epoch-bounded `PromptSource`, the dispatch valves
(the sampler's admission gate, buffer capacity, the in-flight cap, and the refit gate),
launching one task per prompt group, committing finished groups with their start/end
weight versions, its own resumable state (prompts drawn but not yet dispatched,
counters), and what it is waiting on (for the watchdog and progress).

Does not own: staleness policy (sampler), training, or refit (it only obeys the gate the
refitter closes and answers "is everything up to step s committed?").
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

from rl_core.buffer.replay_buffer import ReplayBuffer, SlotState
from rl_core.controller.events import Timeline, VersionClock, notify, wait_until
from rl_core.protocols import Environment, GenerationBackend
from rl_core.rollout.group import generate_group
from rl_core.types import PromptGroup, SamplingParams


@dataclass
class RolloutStats:
    dispatched_groups: int = 0
    committed_groups: int = 0
    aborted_groups: int = 0
    generated_tokens: int = 0
    idle_s: float = 0.0  # time spent waiting on a valve
    per_step_tokens: dict[int, int] = field(default_factory=dict)


class RolloutPump:
    def __init__(self, *, source, sampler, buffer: ReplayBuffer, backend: GenerationBackend, env: Environment,
                 tokenizer, clock: VersionClock, cond: asyncio.Condition, timeline: Timeline,
                 params: SamplingParams, num_generations: int, max_inflight_groups: int, dispatch_limit: int,
                 seed: int):
        self.source = source
        self.sampler = sampler
        self.buffer = buffer
        self.backend = backend
        self.env = env
        self.tokenizer = tokenizer
        self.clock = clock
        self.cond = cond
        self.timeline = timeline
        self.params = params
        self.n = num_generations
        self.max_inflight = max_inflight_groups
        self.dispatch_limit = dispatch_limit  # no group is dispatched for a target step >= this
        self.seed = seed
        self.stats = RolloutStats()
        self.inflight: dict[str, asyncio.Task] = {}
        self.inflight_targets: dict[str, int] = {}
        self.dispatch_open = True  # closed by the refitter's drain gate and by checkpoints
        self.waiting_on = "not started"
        self.exhausted = False
        self._stop = False
        self._pending: list = []  # prompts drawn from the source but not dispatched yet
        self._failure: BaseException | None = None

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Only valid at a quiescent point (nothing in flight)."""
        assert not self.inflight, "rollout state captured while groups are in flight"
        return {"pending": [[int(i), int(e), ex] for i, e, ex in self._pending],
                "stats": {k: v for k, v in asdict(self.stats).items() if k != "per_step_tokens"}}

    def load_state_dict(self, state: dict) -> None:
        self._pending = [tuple(p) for p in state["pending"]]
        for k, v in state["stats"].items():
            setattr(self.stats, k, v)

    # ------------------------------------------------------------------ control from other parts

    async def set_dispatch_open(self, is_open: bool) -> None:
        self.dispatch_open = is_open
        await notify(self.cond)

    async def wait_idle(self) -> None:
        """Wait until no group is in flight."""
        await wait_until(self.cond, lambda: not self.inflight or self._failure is not None)
        self._raise_failed()

    async def wait_committed_through(self, step: int) -> None:
        """Wait until every group for target steps <= `step` is dispatched and finished
        (the reproducible refit barrier). Stops waiting when no more can be dispatched."""
        def done() -> bool:
            if self._failure is not None:
                return True
            all_dispatched = (self.sampler.next_target_step() > step or self.exhausted or self._stop
                              or self.sampler.next_target_step() >= self.dispatch_limit)
            return all_dispatched and not any(t <= step for t in self.inflight_targets.values())
        await wait_until(self.cond, done)
        self._raise_failed()

    async def stop(self) -> None:
        self._stop = True
        await notify(self.cond)

    # ------------------------------------------------------------------ the pump

    def _admissible(self) -> bool:
        return self._stop or self._failure is not None or (
            self.dispatch_open
            and self.sampler.can_admit(self.clock.version)
            and self.buffer.has_capacity()
            and len(self.inflight) < self.max_inflight
        )

    def _describe_wait(self) -> str:
        if not self.dispatch_open:
            return "dispatch gate (paused for a refit drain or a checkpoint)"
        if not self.sampler.can_admit(self.clock.version):
            return (f"sampler admission ({self.sampler.name}: next target step {self.sampler.next_target_step()} "
                    f"> trainer version {self.clock.version} + lookahead {self.sampler.staleness_bound})")
        if not self.buffer.has_capacity():
            return f"buffer capacity ({self.buffer.live()}/{self.buffer.capacity} slots live)"
        if len(self.inflight) >= self.max_inflight:
            return f"in-flight cap ({len(self.inflight)}/{self.max_inflight} groups generating)"
        return "nothing"

    async def run(self) -> None:
        try:
            while not self._stop:
                if self.sampler.next_target_step() >= self.dispatch_limit:
                    break
                if not self._pending:
                    batch = self.source.next_batch()
                    if batch is None:
                        break
                    self._pending = [tuple(d) for d in batch]
                self.waiting_on = self._describe_wait()
                t0 = time.monotonic()
                await wait_until(self.cond, self._admissible)
                self.stats.idle_s += time.monotonic() - t0
                self._raise_failed()
                if self._stop:
                    break
                index, epoch, example = self._pending.pop(0)
                self._dispatch(index, epoch, example)
            self.waiting_on = "in-flight groups to finish"
            await wait_until(self.cond, lambda: not self.inflight or self._failure is not None)
            self._raise_failed()
        finally:
            for task in self.inflight.values():
                task.cancel()
            self.exhausted = True
            self.waiting_on = "done"
            await notify(self.cond)

    def _raise_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _dispatch(self, index: int, epoch: int, example: dict) -> None:
        version = self.clock.version
        target = self.sampler.admit(version)
        dispatch_index = self.stats.dispatched_groups
        group_id = f"e{epoch}-p{index}-d{dispatch_index}"
        self.buffer.reserve(group_id, dispatch_index, index, epoch, version, target)
        self.stats.dispatched_groups += 1
        self.inflight_targets[group_id] = target
        self.inflight[group_id] = asyncio.create_task(self._guarded(group_id, index, epoch, example, version, target))

    async def _guarded(self, group_id: str, *args) -> None:
        """Runs one group; records a failure for the pump to raise, always frees its in-flight place."""
        try:
            await self._run_group(group_id, *args)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the pump, which re-raises it
            if self._failure is None:
                self._failure = exc
        finally:
            self.inflight.pop(group_id, None)
            self.inflight_targets.pop(group_id, None)
            await notify(self.cond)

    async def _run_group(self, group_id: str, index: int, epoch: int, example: dict, version: int,
                         target: int) -> None:
        t0 = time.monotonic()
        prompt_ids = self.env.prompt_ids(example)
        samples = await generate_group(self.backend, self.env, self.tokenizer, example, prompt_ids, self.n,
                                       self.params, group_id, (self.seed, epoch, index))
        if any(s.finish_reason == "abort" for s in samples):
            self.stats.aborted_groups += 1
            await self.buffer.finish([self.buffer.get(group_id)], SlotState.ABORTED)
            return
        t1 = time.monotonic()
        group = PromptGroup(group_id=group_id, prompt_index=index, epoch=epoch, example=example, samples=samples,
                            start_version=version, end_version=max(s.end_version for s in samples),
                            target_step=target, dispatched_at=t0, committed_at=t1)
        ntok = sum(len(s.completion_ids) for s in samples)
        self.stats.generated_tokens += ntok
        self.stats.per_step_tokens[target] = self.stats.per_step_tokens.get(target, 0) + ntok
        self.stats.committed_groups += 1
        self.timeline.add("generate", target, t0, t1, version)
        await self.buffer.commit(group_id, group)
