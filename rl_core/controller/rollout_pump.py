"""The rollout pump: prompts -> generation -> environment -> replay buffer.

Owns: drawing prompt batches from the epoch-bounded `PromptSource` (each batch's seeds in one
pass, its prompts' ids in one encode where the environment is a `BatchPromptEnvironment`:
`BatchPrompts`); the dispatch valves (the sampler's admission gate, buffer capacity, the
in-flight caps, the over-sampling bound, the dispatch gate); one task per prompt group with
retries, backoff, deadlines and the drop budget; serving the train pump's requests in the
`PumpLedger` (refills, aborting groups the sampler declares stale, a drain's closed gate);
at the run's end (`stop`) aborting the groups no step will train; committing finished groups
with their versions and the target step their buffer slot holds (partial rollouts move it);
its resumable state and what it waits on (watchdog, progress).

Does not own: staleness policy (sampler), training, refit, or the failure taxonomy
(rl_core.resilience). docs/controller.md, "Backpressure valves", has each valve's knob.
"""

from __future__ import annotations

import asyncio
import math
import operator
import time
from collections import Counter
from typing import TYPE_CHECKING, Callable

from rl_core.buffer.replay_buffer import ReplayBuffer, SlotState
from rl_core.controller.events import Timeline, VersionClock, notify, wait_until
from rl_core.controller.ledger import PumpLedger, RolloutStats
from rl_core.protocols import BatchPromptEnvironment, Environment, GenerationBackend
from rl_core.algorithms.shaping import shape_group
from rl_core.resilience import Attempts, FailureKind, GroupDropped, cancel_and_wait, group_failed, retrying
from rl_core.rollout.group import GenerationSlots, GroupOptions, generate_group, seeds_of_groups
from rl_core.types import PromptGroup, SamplingParams
from rl_core.columns import group_columns

if TYPE_CHECKING:
    from rl_core.rollout.session_server import SessionServer


class RolloutPump:
    def __init__(self, *, cfg, source, sampler, buffer: ReplayBuffer, backend: GenerationBackend, env: Environment,
                 tokenizer, clock: VersionClock, cond: asyncio.Condition, timeline: Timeline,
                 params: SamplingParams, ledger: PumpLedger, sessions: SessionServer | None = None,
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
        self.ledger = ledger  # shared with the train pump: counters, demand, requests (see ledger.py)
        self.stats: RolloutStats = ledger.rollout_stats  # this pump's counters, read by step_metrics
        self.dropped_per_step: Counter[int] = ledger.dropped_per_step  # read by the train pump's quota
        self.on_retry = on_retry  # told of every retried failure (the controller's console notices)
        self.seed = cfg.grpo.seed
        self.opts = GroupOptions(
            generation_timeout_s=a.failure.generation_timeout_s, env_timeout_s=a.failure.env_timeout_s,
            gen_slots=GenerationSlots(a.max_inflight_generations) if a.max_inflight_generations else None,
            mask_flagged_samples=cfg.env.mask_flagged_samples, sessions=sessions)
        # a drawn batch's prompt ids in one encode, where the environment has the batch encode
        self._encode_batch = env.start_prompt_ids_many if isinstance(env, BatchPromptEnvironment) else None
        rs = cfg.reward_shaping
        self.shaping = cfg.reward_shaping if (rs.overlong_filtering or rs.overlong_penalty.enabled
                                              or rs.scaling.enabled) else None
        self.max_tokens = cfg.generation.max_tokens
        self.inflight: dict[str, asyncio.Task] = {}
        self.dispatch_open = True  # closed by checkpoints and validation (a drain refit: `ledger.draining`)
        self._waiting_on: str | None = "not started"
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

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Only valid at a quiescent point (nothing in flight)."""
        assert not self.inflight, "rollout state captured while groups are in flight"
        return {"pending": [[int(i), int(e), ex] for i, e, ex in self._pending], **self.ledger.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._pending = [tuple(p) for p in state["pending"]]
        self.ledger.load_state_dict(state)

    # ------------------------------------------------------------------ control from other parts

    async def set_dispatch_open(self, is_open: bool) -> None:
        self.dispatch_open = is_open
        await notify(self.cond)

    async def wait_idle(self) -> None:
        """Wait until no group is in flight."""
        await wait_until(self.cond, lambda: not self.inflight or self.ledger.failure is not None)
        self._raise_failed()

    async def stop(self) -> None:
        """The train pump is done: dispatch ends, and groups still in flight are aborted (no step
        will train them) rather than waited for."""
        self._stop = True
        await notify(self.cond)

    # ------------------------------------------------------------------ the train pump's requests

    async def _serve(self) -> None:
        """Serve what the train pump asked for in the ledger: a fresh prompt per queued refill
        (dynamic sampling set a group of the step in training aside; past the admission gate and
        capacity), then the abort of the in-flight groups the sampler declares stale at the
        requested trainer version (frees the engine at once)."""
        ledger = self.ledger
        while ledger.requests():  # (a request made while this one awaits is served before returning)
            while ledger.refills:
                target = ledger.refills.popleft()
                prompt = self._next_prompt()
                if prompt is None:
                    raise RuntimeError(f"no prompts left to refill step {target} (dynamic sampling dropped its "
                                       "groups); raise grpo.max_num_epochs or use more training data")
                self.stats.refill_groups += 1
                self._dispatch(*prompt, target, force=True)
            if ledger.stale_at > ledger.stale_served:
                version = ledger.stale_at
                stale = [gid for gid in list(self.inflight)
                         if self.sampler.should_abort_inflight(self.buffer.get(gid), version)]
                for gid in stale:
                    self.inflight[gid].cancel()
                if stale:
                    await asyncio.gather(*(self.inflight[g] for g in stale if g in self.inflight),
                                         return_exceptions=True)
                ledger.stale_aborted_groups += len(stale)
                ledger.stale_served = version
                await notify(self.cond)

    async def _wait(self, predicate: Callable[[], bool]) -> None:
        """Wait until `predicate()` holds, serving the train pump's requests meanwhile."""
        ledger = self.ledger
        while True:
            await wait_until(self.cond, lambda: predicate() or ledger.requests())
            if self._stop or ledger.failure is not None or not ledger.requests():
                return
            await self._serve()

    # ------------------------------------------------------------------ valves

    def _oversampling_ok(self) -> bool:
        demand = self.ledger.demand
        if self.sampler.stamps or demand is None:
            return True
        window = self.sampler.window
        if window is None:
            window = self.sampler.staleness_bound or 0
        need = min(demand, self.groups_per_step * (window + 1))
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
        return self._stop or self.ledger.failure is not None or (
            self.dispatch_open
            and not self.ledger.draining
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
        if not self.dispatch_open or self.ledger.draining:
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
            return self.sampler.next_target_step() >= self.ledger.dispatch_limit
        return self.ledger.demand is not None and self.ledger.demand <= 0

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
        the environment can (`protocols.BatchPromptEnvironment.start_prompt_ids_many`: the same
        ids as `prompt_ids`, its Rust encode running while the pump dispatches: `BatchPrompts`);
        empty otherwise. A batch whose encoding fails is left to each group, which then encodes
        its own prompt and fails (a data error of that group, retried or dropped) as without
        the batch."""
        if self._encode_batch is None or not self._pending:
            return {}
        keys = [(int(e), int(i)) for i, e, _ in self._pending]
        examples = [ex for _, _, ex in self._pending]
        try:
            return BatchPrompts(keys, self._encode_batch(examples))
        except Exception:  # noqa: BLE001 - not ignored: each group's own prompt_ids raises it again
            return {}

    # ------------------------------------------------------------------ the pump

    async def run(self) -> None:
        def go() -> bool:
            return self._admissible() or self._done_dispatching()

        try:
            while not self._stop and not self._done_dispatching():
                if self.ledger.requests():
                    await self._serve()
                if not self._pending and self.source.exhausted:
                    break
                self._waiting_on = None  # `waiting_on` describes the wait when read (the watchdog)
                if not go():  # (while dispatching a step's groups it holds: no wait, no lock)
                    t0 = time.monotonic()
                    await self._wait(go)
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
            await self._wait(lambda: not self.inflight or self._stop or self.ledger.failure is not None)
            self._raise_failed()
            self.ledger.exhausted = True  # dispatch has ended: only the train pump's refills come now
            self.waiting_on = "the train pump's requests (dispatch has ended)"
            await notify(self.cond)
            # until the train pump is done: serve its requests (refills of the step in training)
            await self._wait(lambda: self._stop or self.ledger.failure is not None)
            self._raise_failed()
            if self.inflight:  # stopped: the trainer has trained its last step, no step will train these
                await self._abort_leftovers()
        finally:
            for task in self.inflight.values():
                task.cancel()
            self.ledger.exhausted = True
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
        if self.ledger.failure is not None:
            raise self.ledger.failure

    def _dispatch(self, index: int, epoch: int, example: dict, target: int | None, force: bool = False) -> None:
        version = self.clock.version
        dispatch_index = self.stats.dispatched_groups
        group_id = f"e{epoch}-p{index}-d{dispatch_index}"
        self.buffer.reserve(group_id, dispatch_index, index, epoch, version, target, force=force)
        self.stats.dispatched_groups += 1
        task = asyncio.create_task(self._guarded(group_id, index, epoch, example, version, target))
        if self.opts.gen_slots is not None:
            self._unstarted.add(group_id)
            # a task cancelled before it ever ran skips _guarded's finally: never leave it counted
            task.add_done_callback(lambda _t, g=group_id: self._unstarted.discard(g))
        self.inflight[group_id] = task
        self.ledger.inflight = len(self.inflight)

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
            if self.ledger.failure is None:
                self.ledger.failure = exc
        finally:
            self.inflight.pop(group_id, None)
            self.ledger.inflight = len(self.inflight)
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
        target = self.buffer.get(group_id).target_step  # partial rollouts may have moved it
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
        target = self.buffer.get(group_id).target_step  # partial rollouts may have moved it
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
