"""The rollout pump: prompts -> generation -> environment -> replay buffer.

Owns: drawing prompt batches from the epoch-bounded `PromptSource` (a batch's seeds in one
pass, its prompt ids begun when drawn: `BatchPrompts`); the dispatch valves, each a knob with
a metric (admission gate, buffer capacity, group in-flight cap, generation-level
backpressure, the over-sampling bound, the dispatch gate closed by drains, checkpoints and
validation); one task per prompt group with retries under separate infra/data budgets,
backoff and deadlines; the drop budget (shrink or replace); aborting groups the sampler
declares stale, and at the run's end those no step will train; committing finished groups
with their versions and target step; its resumable state and what it waits on.

Does not own: staleness policy (sampler), training, refit, or the failure taxonomy
(rl_core.resilience). Read more: docs/controller.md, "Backpressure valves", "Resilience".
"""

from __future__ import annotations

import asyncio
import math
import operator
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable

from rl_core.buffer.replay_buffer import ReplayBuffer, SlotState
from rl_core.controller.events import Timeline, VersionClock, notify, wait_until
from rl_core.protocols import Environment, GenerationBackend
from rl_core.algorithms.shaping import shape_group
from rl_core.resilience import Attempts, FailureKind, GroupDropped, cancel_and_wait, group_failed, retrying
from rl_core.rollout.group import GenerationSlots, GroupOptions, generate_group, seeds_of_groups
from rl_core.types import PromptGroup, SamplingParams
from rl_core.columns import group_columns


@dataclass
class RolloutStats:
    dispatched_groups: int = 0
    committed_groups: int = 0
    aborted_groups: int = 0  # aborted in flight (stale) or by the backend
    dropped_groups: int = 0  # exhausted their attempts
    replaced_groups: int = 0
    refill_groups: int = 0  # dispatched to refill steps dynamic sampling thinned
    infra_retries: int = 0
    data_retries: int = 0
    wasted_samples: int = 0  # generated but never trained (aborted / dropped / evicted)
    generated_tokens: int = 0
    idle_s: float = 0.0  # time spent waiting on a valve
    env_s: float = 0.0
    per_step_tokens: dict[int, int] = field(default_factory=dict)


class RolloutPump:
    def __init__(self, *, cfg, source, sampler, buffer: ReplayBuffer, backend: GenerationBackend, env: Environment,
                 tokenizer, clock: VersionClock, cond: asyncio.Condition, timeline: Timeline,
                 params: SamplingParams, dispatch_limit: int, demand: Callable[[], int] | None = None,
                 on_retry: Callable[[FailureKind, BaseException], None] | None = None):
        a = cfg.async_rl
        self.cfg = cfg
        self.source = source
        self.sampler = sampler
        self.buffer = buffer
        self.backend = backend
        self.env = env
        self.tokenizer = tokenizer
        self.clock = clock
        self.cond = cond
        # a commit to the buffer notifies this condition itself (the controller shares it with the buffer)
        self._commit_notifies = buffer.changed is cond
        self.timeline = timeline
        self.params = params
        self.n = cfg.grpo.num_generations_per_prompt
        self.groups_per_step = cfg.grpo.num_prompts_per_step
        self.max_inflight = a.max_inflight_groups
        self.fail = a.failure
        self.over_sampling = a.over_sampling_ratio
        self.dispatch_limit = dispatch_limit  # stamped samplers: no group for a target step >= this
        self.demand = demand  # unstamped samplers: groups the trainer may still consume
        self.on_retry = on_retry  # told of every retried failure (the controller's console notices)
        self.seed = cfg.grpo.seed
        self.opts = GroupOptions(
            generation_timeout_s=a.failure.generation_timeout_s, env_timeout_s=a.failure.env_timeout_s,
            gen_slots=GenerationSlots(a.max_inflight_generations) if a.max_inflight_generations else None,
            mask_flagged_samples=cfg.env.mask_flagged_samples)
        rs = cfg.reward_shaping
        self.shaping = cfg.reward_shaping if (rs.overlong_filtering or rs.overlong_penalty.enabled
                                              or rs.scaling.enabled) else None
        self.max_tokens = cfg.generation.max_tokens
        self.stats = RolloutStats()
        self.dropped_per_step: Counter[int] = Counter()
        self.inflight: dict[str, asyncio.Task] = {}
        self.inflight_targets: dict[str, int] = {}
        self.dispatch_open = True  # closed by the refitter's drain gate, checkpoints, validation
        self._waiting_on: str | None = "not started"
        self.exhausted = False
        self._stop = False
        self._pending: list = []  # prompts drawn from the source but not dispatched yet
        self._seeds: dict[tuple[int, int], list[int]] = {}  # (epoch, index) -> the seeds of a drawn batch's group
        self._seeds_before: dict[tuple[int, int], list[int]] = {}  # the same for the batch before (not yet started)
        self._prompts: BatchPrompts | dict = {}  # (epoch, index) -> its prompt ids, encoded with its batch
        self._prompts_before: BatchPrompts | dict = {}  # the same for the batch before (not yet started)
        # generation-level backpressure: groups dispatched whose samples are not counted as
        # queued yet (their task has not started), and whether dispatch waits on the queue
        self._unstarted: set[str] = set()
        self._blocked_on_queue = False
        self._wakeups: set[asyncio.Task] = set()
        if self.opts.gen_slots is not None:
            self.opts.gen_slots.on_queue_shrunk = self._queue_shrunk
        self._failure: BaseException | None = None

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Only valid at a quiescent point (nothing in flight)."""
        assert not self.inflight, "rollout state captured while groups are in flight"
        return {"pending": [[int(i), int(e), ex] for i, e, ex in self._pending],
                "stats": {k: v for k, v in asdict(self.stats).items() if k != "per_step_tokens"},
                "dropped_per_step": {str(k): v for k, v in self.dropped_per_step.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._pending = [tuple(p) for p in state["pending"]]
        for k, v in state["stats"].items():
            setattr(self.stats, k, v)
        self.dropped_per_step = Counter({int(k): v for k, v in state.get("dropped_per_step", {}).items()})

    @property
    def failure(self) -> BaseException | None:
        """The first exception a group task raised (it stops the run), or None."""
        return self._failure

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
            nxt = self.sampler.next_target_step()
            all_dispatched = nxt > step or self.exhausted or self._stop or nxt >= self.dispatch_limit
            return all_dispatched and not any(t <= step for t in self.inflight_targets.values())
        await wait_until(self.cond, done)
        self._raise_failed()

    async def abort_stale(self, trainer_version: int) -> int:
        """Abort in-flight groups the sampler says can no longer be trained (frees the engine at once)."""
        stale = [gid for gid in list(self.inflight) if self.sampler.should_abort_inflight(self.buffer.get(gid),
                                                                                         trainer_version)]
        for gid in stale:
            self.inflight[gid].cancel()
        if stale:
            await asyncio.gather(*(self.inflight[g] for g in stale if g in self.inflight), return_exceptions=True)
        return len(stale)

    def restamp(self, group_id: str, target: int) -> None:
        """Partial rollouts: the in-flight group now trains in step `target` (the train pump moved it)."""
        if group_id in self.inflight_targets:
            self.inflight_targets[group_id] = target

    async def stop(self) -> None:
        """The train pump is done: dispatch ends, and groups still in flight are aborted (no step
        will train them) rather than waited for."""
        self._stop = True
        await notify(self.cond)

    def request_refill(self, target: int | None) -> None:
        """Dispatch one fresh prompt for the step in training (dynamic sampling dropped one of its
        groups); bypasses the admission gate and may exceed capacity by the refills in flight."""
        prompt = self._next_prompt()
        if prompt is None:
            raise RuntimeError(f"no prompts left to refill step {target} (dynamic sampling dropped its groups); "
                               "raise grpo.max_num_epochs or use more training data")
        self.stats.refill_groups += 1
        self._dispatch(*prompt, target, force=True)

    # ------------------------------------------------------------------ valves

    def _oversampling_ok(self) -> bool:
        if self.sampler.stamps or self.demand is None:
            return True
        window = self.sampler.window
        if window is None:
            window = self.sampler.staleness_bound or 0
        need = min(self.demand(), self.groups_per_step * (window + 1))
        return self.buffer.live() < math.ceil(self.over_sampling * need)

    def _queued_samples(self) -> int:
        """Samples dispatched but not generating yet (waiting for a generation place)."""
        return self.opts.gen_slots.queued + self.n * len(self._unstarted)

    def _generation_queue_ok(self) -> bool:
        """Generation-level backpressure: dispatch while fewer than one group's worth of samples
        waits for a place, so freed places are refilled at once but groups do not pile up
        (and age) behind the limit."""
        if self.opts.gen_slots is None:
            return True
        ok = self._queued_samples() < self.n
        if not ok:
            self._blocked_on_queue = True
        return ok

    def _queue_shrunk(self) -> None:
        if self._blocked_on_queue and self._queued_samples() < self.n:
            self._blocked_on_queue = False
            task = asyncio.get_running_loop().create_task(notify(self.cond))
            self._wakeups.add(task)
            task.add_done_callback(self._wakeups.discard)

    def _admissible(self) -> bool:
        return self._stop or self._failure is not None or (
            self.dispatch_open
            and self.sampler.can_admit(self.clock.version)
            and self.buffer.has_capacity()
            and len(self.inflight) < self.max_inflight
            and self._oversampling_ok()
            and self._generation_queue_ok()
        )

    @property
    def waiting_on(self) -> str:
        """What the pump waits on now (read by the watchdog): the admission condition that fails
        while the dispatch loop waits, else the stage it is in."""
        return self._describe_wait() if self._waiting_on is None else self._waiting_on

    @waiting_on.setter
    def waiting_on(self, what: str) -> None:
        self._waiting_on = what

    def _describe_wait(self) -> str:
        if not self.dispatch_open:
            return "dispatch gate (paused for a refit drain, a checkpoint or validation)"
        if not self.sampler.can_admit(self.clock.version):
            return (f"sampler admission ({self.sampler.name}: next batch {self.sampler.next_target_step()} "
                    f"> trainer version {self.clock.version} + window {self._window_now()})")
        if not self.buffer.has_capacity():
            return f"buffer capacity ({self.buffer.live()}/{self.buffer.capacity} slots live)"
        if len(self.inflight) >= self.max_inflight:
            return f"group in-flight cap ({len(self.inflight)}/{self.max_inflight} groups generating)"
        if not self._oversampling_ok():
            return f"over-sampling bound ({self.buffer.live()} live groups, ratio {self.over_sampling})"
        if not self._generation_queue_ok():
            return (f"generation places ({self._queued_samples()} samples wait for one of "
                    f"{self.opts.gen_slots.limit} places)")
        return "nothing"

    def _window_now(self):
        """The admission window at the current version (an adaptive in_order bound may change per version)."""
        return self.sampler.lookahead_at(self.clock.version)

    def _done_dispatching(self) -> bool:
        if self.sampler.stamps:
            return self.sampler.next_target_step() >= self.dispatch_limit
        return self.demand is not None and self.demand() <= 0

    def _next_prompt(self):
        if not self._pending:
            batch = self.source.next_batch()
            if batch is None:
                return None
            self._pending = [tuple(d) for d in batch]
            # the batch's seeds in one pass (`seeds_of_groups`); a group not found here (restored
            # from a checkpoint, retried) derives its own, the same values
            parts = [(self.seed, int(e), int(i)) for i, e, _ in self._pending]
            # the previous batch's seeds and prompts are kept until this batch's replace them: a batch
            # is drawn as soon as the last one is dispatched, before its groups' tasks have started
            self._seeds_before, self._seeds = self._seeds, dict(zip(map(operator.itemgetter(1, 2), parts),
                                                                    seeds_of_groups(parts, self.n)))
            self._prompts_before, self._prompts = self._prompts, self._batch_prompt_ids()
        return self._pending.pop(0)

    def _batch_prompt_ids(self) -> "BatchPrompts | dict":
        """(epoch, index) -> prompt ids of the drawn batch's groups, encoded in one call where
        the environment can (`BaseEnv.prompt_ids_many`: the same ids as `prompt_ids`; through
        `start_prompt_ids_many` where it has that, whose Rust encode runs while the pump
        dispatches: `BatchPrompts`); empty otherwise. A batch whose encoding fails is left to
        each group, which then encodes its own prompt and fails (a data error of that group,
        retried or dropped) as without the batch."""
        start = getattr(self.env, "start_prompt_ids_many", None)
        many = getattr(self.env, "prompt_ids_many", None)
        if (start is None and many is None) or not self._pending:
            return {}
        keys = [(int(e), int(i)) for i, e, _ in self._pending]
        examples = [ex for _, _, ex in self._pending]
        try:
            if start is not None:
                return BatchPrompts(keys, start(examples))
            ids = many(examples)
        except Exception:  # noqa: BLE001 - not ignored: each group's own prompt_ids raises it again
            return {}
        return BatchPrompts.of(keys, ids)

    # ------------------------------------------------------------------ the pump

    async def run(self) -> None:
        def go() -> bool:
            return self._admissible() or self._done_dispatching()

        try:
            while not self._stop and not self._done_dispatching():
                if not self._pending and self.source.exhausted:
                    break
                self._waiting_on = None  # `waiting_on` describes the wait when read (the watchdog)
                if not go():  # (while dispatching a step's groups it holds: no wait, no lock)
                    t0 = time.monotonic()
                    await wait_until(self.cond, go)
                    self.stats.idle_s += time.monotonic() - t0
                self._raise_failed()
                if self._stop or self._done_dispatching():
                    break
                prompt = self._next_prompt()
                if prompt is None:
                    break
                target = self.sampler.admit(self.clock.version)
                self._dispatch(*prompt, target)
            self.waiting_on = "in-flight groups to finish"
            await wait_until(self.cond, lambda: not self.inflight or self._stop or self._failure is not None)
            self._raise_failed()
            if self.inflight:  # stopped: the trainer has trained its last step, no step will train these
                await self._abort_leftovers()
        finally:
            for task in self.inflight.values():
                task.cancel()
            self.exhausted = True
            self.waiting_on = "done"
            await notify(self.cond)

    async def _abort_leftovers(self) -> None:
        """The end of the run: abort the groups still generating (counted as aborted and wasted)
        instead of generating them to completion for no step. They exist only where nothing will
        consume them: over-sampled groups of an unstamped sampler, or groups run ahead past
        `stop_step` with no final checkpoint (a checkpoint waits for every in-flight group first)."""
        self.waiting_on = "aborting groups no step will train"
        await cancel_and_wait(list(self.inflight.values()))

    def _raise_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _dispatch(self, index: int, epoch: int, example: dict, target: int | None, force: bool = False) -> None:
        version = self.clock.version
        dispatch_index = self.stats.dispatched_groups
        group_id = f"e{epoch}-p{index}-d{dispatch_index}"
        self.buffer.reserve(group_id, dispatch_index, index, epoch, version, target, force=force)
        self.stats.dispatched_groups += 1
        if target is not None:
            self.inflight_targets[group_id] = target
        task = asyncio.create_task(self._guarded(group_id, index, epoch, example, version, target))
        if self.opts.gen_slots is not None:
            self._unstarted.add(group_id)
            # a task cancelled before it ever ran skips _guarded's finally: never leave it counted
            task.add_done_callback(lambda _t, g=group_id: self._unstarted.discard(g))
        self.inflight[group_id] = task

    async def _guarded(self, group_id: str, index: int, epoch: int, example: dict, version: int,
                       target: int | None) -> None:
        """One group with retries; records a fatal failure for the pump to raise; always frees its place.
        A group just committed skips the notify at the end: the buffer's commit notified the same
        condition, and nothing was awaited since, so no waiter is left that it has not woken."""
        notified = False
        try:
            attempts = Attempts.of(self.fail)
            try:
                await retrying(lambda: self._run_group(group_id, index, epoch, example, version, target, attempts),
                               attempts, self.fail.backoff_base_s, self.fail.max_backoff_s, self._retried)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - its attempts are exhausted: dropped (or the run stops)
                await self._drop(group_id, index, epoch, example, target, attempts, exc)
                return
            notified = self._commit_notifies
        except asyncio.CancelledError:
            slot = self.buffer.find(group_id)
            if slot is not None and slot.state == SlotState.RESERVED:
                self.stats.aborted_groups += 1
                self.stats.wasted_samples += self.n
                await self.buffer.finish([slot], SlotState.ABORTED)
        except BaseException as exc:  # noqa: BLE001 - handed to the pump, which re-raises it
            if self._failure is None:
                self._failure = exc
        finally:
            self.inflight.pop(group_id, None)
            self.inflight_targets.pop(group_id, None)
            self._unstarted.discard(group_id)
            if not notified:
                await notify(self.cond)

    def _retried(self, kind: FailureKind, exc: Exception) -> None:
        if kind is FailureKind.INFRA:
            self.stats.infra_retries += 1
        else:
            self.stats.data_retries += 1
        if self.on_retry is not None:
            self.on_retry(kind, exc)

    async def _drop(self, group_id, index, epoch, example, target, attempts: Attempts, exc: Exception) -> None:
        target = self.inflight_targets.get(group_id, target)  # partial rollouts may have moved it
        self.stats.dropped_groups += 1
        self.stats.wasted_samples += self.n
        await self.buffer.finish([self.buffer.get(group_id)], SlotState.ABORTED)
        if self.stats.dropped_groups > self.fail.max_dropped_groups:
            raise group_failed(f"training prompt group {group_id} (example {index}, epoch {epoch})", example, attempts,
                               f"async_rl.failure.max_dropped_groups={self.fail.max_dropped_groups} is spent") from exc
        if target is None:
            return  # unstamped samplers: demand-driven dispatch replaces it by itself
        if self.fail.on_dropped_group == "replace":
            prompt = self._next_prompt()
            if prompt is not None:
                self.stats.replaced_groups += 1
                self._dispatch(*prompt, target)
                return
        self.dropped_per_step[target] += 1
        floor = math.ceil(self.fail.min_step_batch_fraction * self.groups_per_step)
        if self.groups_per_step - self.dropped_per_step[target] < floor:
            raise GroupDropped(
                f"step {target} shrank to {self.groups_per_step - self.dropped_per_step[target]} groups, below the "
                f"floor of {floor} (async_rl.failure.min_step_batch_fraction={self.fail.min_step_batch_fraction}); "
                f"last failure: {attempts.describe()}. Fix: repair the cause or lower the floor.") from exc

    async def _run_group(self, group_id: str, index: int, epoch: int, example: dict, version: int,
                         target: int | None, attempts: Attempts) -> None:
        t0 = time.monotonic()
        at = (int(epoch), int(index))
        prompt_ids = self._prompts.pop(at, None) or self._prompts_before.pop(at, None)  # encoded with its batch
        if prompt_ids is None:  # a retry, a group restored from a checkpoint, or no batch encoding
            prompt_ids = self.env.prompt_ids(example)
        key = f"{group_id}/a{attempts.infra + attempts.data}"
        self._unstarted.discard(group_id)  # generate_group counts its samples as queued from here on
        samples = await generate_group(self.backend, self.env, self.tokenizer, example, prompt_ids, self.n,
                                       self.params, key, (self.seed, epoch, index), self.opts,
                                       self._seeds.pop(at, None) or self._seeds_before.pop(at, None))
        cols = group_columns(samples)  # a single-turn group's columns (GroupSamples), read without building Samples
        if "abort" in cols.finish_reasons:
            raise ConnectionAbortedError(f"the backend aborted a sample of {group_id}")  # INFRA: retried
        target = self.inflight_targets.get(group_id, target)  # partial rollouts may have moved it
        metrics = {}
        if self.shaping is not None:  # scaling, DAPO overlong penalty, overlong filtering
            shaped = shape_group(self.shaping, samples, self.max_tokens)
            samples, metrics = shaped.samples, {f"shaping/{k}": v for k, v in shaped.metrics.items()}
            cols = group_columns(samples)
        t1 = time.monotonic()
        end_version, ntok, env_s = max(cols.end_versions), sum(cols.completion_lens), sum(cols.env_s)
        group = PromptGroup(group_id=group_id, prompt_index=index, epoch=epoch, example=example, samples=samples,
                            start_version=version, end_version=end_version,
                            target_step=target, dispatched_at=t0, committed_at=t1, metrics=metrics)
        self.stats.generated_tokens += ntok
        self.stats.env_s += env_s
        step = target if target is not None else self.sampler.next_target_step()
        self.stats.per_step_tokens[step] = self.stats.per_step_tokens.get(step, 0) + ntok
        self.stats.committed_groups += 1
        self.timeline.add("generate", -1 if target is None else target, t0, t1, version)
        await self.buffer.commit(group_id, group)


class BatchPrompts:
    """(epoch, index) -> prompt ids of a drawn batch's groups (`RolloutPump._batch_prompt_ids`),
    read by `pop` as a dict: the batch's encode, begun when the batch was drawn
    (`start_prompt_ids_many`), is waited for on the first `pop` of one of its keys (the first
    of its groups to start), by then mostly done: the pump dispatched the batch's groups
    meanwhile. An encode that fails, or gives no list of one entry per group, leaves every
    group to encode its own prompt, as a failed batch encode did before."""

    __slots__ = ("_keys", "_asked", "_result", "_ids")

    def __init__(self, keys: list[tuple[int, int]], result):
        self._keys, self._asked, self._result, self._ids = keys, frozenset(keys), result, None

    @classmethod
    def of(cls, keys: list[tuple[int, int]], ids) -> dict:
        """The dict of an encode done already (`prompt_ids_many`)."""
        return {} if ids is None or len(ids) != len(keys) else dict(zip(keys, ids))

    def pop(self, key: tuple[int, int], default=None):
        if self._ids is None:
            if key not in self._asked:  # another batch's group: this batch's encode is not waited for
                return default
            try:
                ids = self._result()
            except Exception:  # noqa: BLE001 - not ignored: each group's own prompt_ids raises it again
                ids = None
            self._ids, self._keys, self._asked, self._result = self.of(self._keys, ids), None, None, None
        return self._ids.pop(key, default)
