"""The train pump: buffer -> sampler -> advantages -> trainer (split step API) -> refit.

Owns: the RL step loop (one RL step = one weight version; PPO mini-steps inside it counted
apart), the step quota (shrunk by the groups dropped for it), eviction, partial rollouts
(swapping the buffer slots' steps of a straggler and a ready later group: `carry_over`),
dynamic sampling (zero-variance groups set aside, refills asked for), streaming chunks into
the trainer (or the whole step: reproducible runs, PPO), the critic, bounded retries, and the
step's end: finish -> refit -> abort stale in-flight groups -> step hook (metrics,
validation, spool) -> checkpoint hook (quiescent) -> publish the new version. It meets the
rollout pump only at the buffer, the version clock and the `PumpLedger` (its requests there).
Trainer calls run in worker threads, so the event loop keeps running while the trainer computes.

Does not own: which groups are eligible (sampler), generation (rollout pump), advantage formulas
(advantage_stage), how weights move (refit.py), checkpoint contents (controller).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import torch

from rl_core.algorithms.metrics import merge_metrics
from rl_core.algorithms.shaping import dropped_groups_budget
from rl_core.buffer.replay_buffer import OpenStep, ReplayBuffer, Slot, SlotState, TrainedGroup
from rl_core.controller.advantage_stage import AdvantageStage
from rl_core.controller.events import Timeline, VersionClock, notify, wait_until
from rl_core.controller.ledger import PumpLedger
from rl_core.controller.step_metrics import step_metrics
from rl_core.types import TrainChunk


@dataclass
class _StepBatch:
    """What one RL step has collected so far (local to `TrainPump.train_step`)."""

    trained: list[TrainedGroup] = field(default_factory=list)  # the step's groups with their advantages
    stage_chunks: list[TrainChunk] = field(default_factory=list)  # one per advantage build (PPO concatenates them)
    chunks: list[TrainChunk] = field(default_factory=list)  # policy training chunks (kept for replays and the critic)
    idle: float = 0.0  # seconds waiting for selectable groups
    t_train0: float | None = None  # when training could start (the first advantages)


class TrainStepFailed(RuntimeError):
    """Training of one RL step kept failing after its retries; the run stops (with a checkpoint)."""


StepHook = Callable[[int, dict, list[TrainedGroup]], Awaitable[None]]


def needs_prev_logprobs(cfg) -> bool:
    """Previous-policy logprobs must be computed before training only when an RL step holds
    several optimizer steps: otherwise they equal the current logprobs (detached)."""
    return cfg.grpo.optimizer_steps_per_rl_step > 1


def needs_reference_logprobs(cfg) -> bool:
    """Reference-policy logprobs are needed only for a KL term to the reference (loss or reward):
    `RecipeConfig.needs_reference_policy`. The training run's gate: `rl_core.launch.train.build_parts`
    asks it whether the trainer keeps the frozen reference policy."""
    return cfg.needs_reference_policy


class TrainPump:
    def __init__(self, *, cfg, sampler, buffer: ReplayBuffer, trainer, loss, refitter, clock: VersionClock,
                 cond: asyncio.Condition, timeline: Timeline, ledger: PumpLedger, stop_step: int, pad_id: int,
                 on_step: StepHook | None = None, on_checkpoint: Callable[[int], Awaitable[None]] | None = None,
                 on_ministep: Callable[[OpenStep], Awaitable[None]] | None = None, critic=None):
        self.cfg = cfg
        self.sampler = sampler
        self.buffer = buffer
        self.trainer = trainer
        self.critic = critic
        self.loss = loss
        self.refitter = refitter
        self.clock = clock
        self.cond = cond
        self.timeline = timeline
        self.ledger = ledger  # shared with the rollout pump: counters, demand, requests (see ledger.py)
        self.stop_step = stop_step
        self.pad_id = pad_id
        self.on_step = on_step
        self.on_checkpoint = on_checkpoint
        self.stage = AdvantageStage(cfg, trainer, critic, pad_id, run_pass=self._pass)
        self.per_step = cfg.grpo.num_prompts_per_step
        self.mini_steps = cfg.grpo.optimizer_steps_per_rl_step
        self.whole_step = cfg.async_rl.reproducible or self.mini_steps > 1
        self.ds_budget = dropped_groups_budget(cfg.reward_shaping.dynamic_sampling, self.per_step)
        self.waiting_on = "not started"
        self.idle_s = 0.0
        self.gc_clock = None  # a metrics.gc_pauses.GcClock while the pumps run: timing/gc_* per step
        self.selected_in_step = 0  # groups of the open step already taken from the buffer
        self.stats = ledger.train_stats  # evicted / set-aside groups, wasted samples, retries (read by step_metrics)
        self._step_retries = 0  # policy-update retries used by the RL step in progress
        self._open_step: OpenStep | None = None  # the open RL step after its last completed PPO mini-step
        self.carried_groups = 0  # partial rollouts: stragglers moved to a later step (each move counted)
        self._open = False  # a trainer step is open (begin called, finish not yet)
        self.policy_frozen = False  # critic warm-up: the policy is not updated this step
        self._open_slots: list[Slot] = []  # groups taken for the step in progress
        self.step_pairs: dict[str, list[float]] = {}  # (sum, count) metrics of the step in progress
        self._filtered_in_step = 0
        self.current_step = trainer.version
        self.resume_open_step: OpenStep | None = None  # an RL step checkpointed between its mini-steps
        self.on_ministep = on_ministep  # may checkpoint between mini-steps
        self.trained_group_ids: list[str] = []
        self.staleness_log: list[int] = []
        self._publish_demand()

    # ------------------------------------------------------------------ bookkeeping

    @property
    def train_retries(self) -> int:
        return self.stats.train_retries

    @property
    def dynamic_filtered_groups(self) -> int:
        return self.stats.dynamic_filtered_groups

    @property
    def stale_aborted_groups(self) -> int:
        """In-flight groups aborted as stale (by the rollout pump, at this pump's request)."""
        return self.ledger.stale_aborted_groups

    def quota(self, step: int) -> int:
        """Groups step `step` trains: fewer when the rollout pump dropped some of its groups."""
        if self.sampler.stamps:
            return self.per_step - self.ledger.dropped_per_step.get(step, 0)
        return self.per_step

    def demand(self) -> int:
        """Groups the trainer may still consume before `stop_step` (drives unstamped dispatch).
        Counted from the pump's own step counter: the trainer's version changes inside a worker
        thread, before the pump has reset its per-step count."""
        return max(0, (self.stop_step - self.current_step) * self.per_step - self.selected_in_step)

    def _publish_demand(self) -> None:
        """`demand()` into the ledger (the rollout pump reads it): after every change of the step
        counter or of the groups taken, before the next suspension point."""
        self.ledger.demand = self.demand()

    async def run(self) -> None:
        while self.trainer.version < self.stop_step:
            await self.train_step(self.trainer.version, resume=self.resume_open_step)
            self.resume_open_step = None
        self.waiting_on = "done"

    def open_step_after_failure(self) -> OpenStep | None:
        """The RL step a failure interrupted after some of its PPO mini-steps had updated the policy
        (their updates cannot be undone): its open-step state after the last completed mini-step,
        to checkpoint so that a resume continues at the next mini-step instead of training the
        step's groups again from the start. None when no mini-step of the step had completed."""
        return self._open_step

    async def return_open_step(self) -> None:
        """Put the groups of a failed, unfinished step back into the buffer as ready."""
        await self.buffer.restore_ready(self._open_slots)
        self._open_slots = []
        self.selected_in_step = 0
        self._publish_demand()

    # ------------------------------------------------------------------ selection

    async def _evict(self) -> None:
        gone = self.sampler.evict(self.buffer, self.trainer.version)
        if gone:
            self.stats.evicted_groups += len(gone)
            self.stats.wasted_samples += sum(len(s.group.samples) for s in gone if s.group)
            await self.buffer.finish(gone, SlotState.EVICTED)

    async def _select(self, step: int, want: int, most: int) -> list[Slot]:
        """Wait until at least `want` groups are selectable (or the quota shrinks), then take up to
        `most`; zero-variance groups are set aside (dynamic sampling) and the step refilled."""
        while True:
            await self._evict()
            need = min(want, self.quota(step) - self.selected_in_step)
            self._carry_over(step, need)
            slots = self.sampler.select(self.buffer, self.trainer.version, most)
            if slots and len(slots) >= need:
                if self.whole_step:
                    slots = sorted(slots, key=lambda s: s.dispatch_index)
                keep, ds_metrics = self.stage.filter([s.group for s in slots[:most]])
                merge_metrics(self.step_pairs, {f"dynamic_sampling/{k}": v for k, v in ds_metrics.items()})
                kept = [s for s, k in zip(slots, keep) if k]
                dropped = [s for s, k in zip(slots, keep) if not k]
                await self.buffer.finish(kept, SlotState.SELECTED)
                if dropped:
                    await self._set_aside(step, dropped)
                self.selected_in_step += len(kept)
                self._publish_demand()
                self._open_slots.extend(kept)
                if kept:
                    return kept
                continue
            ledger = self.ledger
            if ledger.failure is not None:
                raise ledger.failure
            if ledger.exhausted and not ledger.inflight and not ledger.refills:  # refills may still come
                raise RuntimeError(f"rollouts ended with step {step} incomplete "
                                   f"({self.selected_in_step}/{self.quota(step)} groups)")
            self.waiting_on = (f"{need} ready group(s) for step {step} "
                               f"(have {self.selected_in_step}/{self.quota(step)})")
            def progress() -> tuple:
                return self.buffer.num_ready(), self.quota(step), ledger.exhausted, ledger.inflight, len(ledger.refills)

            snapshot = progress()
            await wait_until(self.cond, lambda: ledger.failure is not None or snapshot != progress())

    def _carry_over(self, step: int, need: int) -> None:
        """Partial rollouts: swap the target steps of the stragglers of `step` and the ready groups
        of later steps the sampler pairs them with, so the step trains those instead of waiting.
        The straggler's slot carries its new step: the rollout pump commits it with that step."""
        for straggler, sub in self.sampler.carry_over(self.buffer, step, need):
            later = sub.target_step
            self.buffer.restamp(sub.group_id, step)
            self.buffer.restamp(straggler.group_id, later)
            straggler.carried += 1
            self.carried_groups += 1

    async def _set_aside(self, step: int, dropped: list[Slot]) -> None:
        """Dynamic sampling dropped these zero-variance groups: count them and refill the step."""
        self._filtered_in_step += len(dropped)
        self.stats.dynamic_filtered_groups += len(dropped)
        self.stats.wasted_samples += sum(len(s.group.samples) for s in dropped)
        await self.buffer.finish(dropped, SlotState.EVICTED)
        if self._filtered_in_step > self.ds_budget:
            raise RuntimeError(
                f"dynamic sampling dropped {self._filtered_in_step} zero-variance groups while filling RL step {step} "
                f"(budget reward_shaping.dynamic_sampling.max_num_dropped_groups_per_step={self.ds_budget}): every "
                "group gets the same reward, so the task is too easy or too hard for the policy. Fix: change the "
                "data or the reward, or raise the budget.")
        if self.sampler.stamps:  # unstamped samplers refill by demand
            self.ledger.refills.extend([step] * len(dropped))  # the rollout pump dispatches them
            await notify(self.cond)

    # ------------------------------------------------------------------ one RL step

    async def train_step(self, step: int, resume: OpenStep | None = None) -> dict:
        """One RL step: select its groups and compute their advantages (or reopen a step
        checkpointed between its mini-steps), train them in the run's mode (streamed chunks,
        the whole step at once, or PPO mini-steps), then end the step (refit, metrics, hooks)."""
        t_step0 = time.monotonic()
        self._begin_step(step)
        batch = _StepBatch()
        if resume is not None:  # continue an RL step checkpointed between its mini-steps
            self._reopen(resume, batch)
        elif self.mini_steps > 1:
            await self._collect(step, batch, on_chunk=None)
        elif self.whole_step:
            await self._collect(step, batch, on_chunk=self._queue_whole)
        else:
            await self._collect(step, batch, on_chunk=self._stream)
        self.waiting_on = f"trainer (step {step})"
        if self.mini_steps > 1:
            train_metrics = await self._train_ppo(step, batch, resume)
        elif self.whole_step:
            train_metrics = await self._train_whole(step, batch)
        else:
            train_metrics = await self._train_streamed(step, batch)
        return await self._end_step(step, batch, train_metrics, t_step0)

    def _begin_step(self, step: int) -> None:
        self.current_step = step
        self.selected_in_step, self._filtered_in_step, self.step_pairs = 0, 0, {}
        self._publish_demand()
        self._step_retries = 0
        self._open_step = None
        self._open_slots = []
        self.policy_frozen = self.critic is not None and step < self.cfg.critic.num_warmup_steps

    def _reopen(self, resume: OpenStep, batch: _StepBatch) -> None:
        """Take back the groups and the batch of a step checkpointed between its mini-steps."""
        batch.trained = resume.trained
        self._open_slots = [t.slot for t in batch.trained]
        self.selected_in_step = len(batch.trained)
        self._publish_demand()
        batch.stage_chunks = [resume.chunk]
        batch.t_train0 = time.monotonic()

    async def _collect(self, step: int, batch: _StepBatch,
                       on_chunk: Callable[[int, _StepBatch, TrainChunk, int], Awaitable[None]] | None) -> None:
        """Select the step's groups as the sampler releases them (a few at a time when streaming,
        else the whole quota) and compute their advantages; `on_chunk(step, batch, chunk,
        num_groups)` after each advantage chunk (the mode's training of it)."""
        m = self.cfg.async_rl.min_groups_for_streaming_train
        while self.selected_in_step < self.quota(step):
            remaining = self.quota(step) - self.selected_in_step
            want = remaining if self.whole_step else min(m, remaining)
            t0 = time.monotonic()
            slots = await self._select(step, want, remaining)
            batch.idle += time.monotonic() - t0
            chunk = await self._advantages(step, slots, batch)
            if on_chunk is not None:
                await on_chunk(step, batch, chunk, len(slots))

    async def _advantages(self, step: int, slots: list[Slot], batch: _StepBatch) -> TrainChunk:
        """Advantages of the selected groups (advantage stage); records them in `batch`."""
        self.waiting_on = f"advantages (step {step})"
        st = await self.stage.build([s.group for s in slots])
        merge_metrics(self.step_pairs, {f"advantage/{k}": v for k, v in st.metrics.items()})
        for g in st.groups:
            if g.metrics:  # reward shaping's pairs, when shaping is on
                merge_metrics(self.step_pairs, g.metrics)
        for s, g, a in zip(slots, st.groups, st.advantages):
            batch.trained.append(TrainedGroup(s, g, a, step - s.start_version))
        batch.stage_chunks.append(st.chunk)
        if batch.t_train0 is None:
            batch.t_train0 = time.monotonic()
        return st.chunk

    # ------------------------------------------------------------------ the three training modes

    async def _stream(self, step: int, batch: _StepBatch, chunk: TrainChunk, num_groups: int) -> None:
        """Streaming: train each advantage chunk as soon as it is ready."""
        batch.chunks.append(chunk)
        await self._train_chunks(step, batch.chunks, streamed=[chunk])

    async def _train_streamed(self, step: int, batch: _StepBatch) -> dict:
        """Streaming: the chunks are trained already; close the step with the optimizer update."""
        return await self._finish_policy_step(step, batch.chunks)

    async def _queue_whole(self, step: int, batch: _StepBatch, chunk: TrainChunk, num_groups: int) -> None:
        """Whole step (reproducible runs): cut each advantage chunk at fixed boundaries; train later."""
        batch.chunks.extend(self._split(chunk, num_groups, self.cfg.async_rl.min_groups_for_streaming_train))

    async def _train_whole(self, step: int, batch: _StepBatch) -> dict:
        """Whole step: train every chunk of the step, then the optimizer update."""
        await self._train_chunks(step, batch.chunks, streamed=batch.chunks)
        return await self._finish_policy_step(step, batch.chunks)

    async def _finish_policy_step(self, step: int, chunks: list[TrainChunk]) -> dict:
        """The one optimizer update of a step (and the critic's, PPO with one mini-step)."""
        train_metrics = await self._finish(step, chunks)
        if self.critic is not None:
            train_metrics.update(await self._critic_step(chunks, advance=True))
        return train_metrics

    async def _train_ppo(self, step: int, batch: _StepBatch, resume: OpenStep | None) -> dict:
        """PPO mini-steps over the step's whole batch (continuing `resume` when given)."""
        full = TrainChunk.concat(batch.stage_chunks, self.pad_id)
        train_metrics = await self._mini_steps(step, full, batch.trained, resume)
        self._open_step = None
        return train_metrics

    # ------------------------------------------------------------------ the step's end

    async def _end_step(self, step: int, batch: _StepBatch, train_metrics: dict, t_step0: float) -> dict:
        """Refit, abort stale groups, metrics, the step and checkpoint hooks, publish the version."""
        trained = batch.trained
        t_finish = time.monotonic()
        self.current_step, self.selected_in_step = step + 1, 0  # demand() now counts from the next step
        self._publish_demand()
        self._open_slots = []
        self.timeline.add("train", step, batch.t_train0 or t_finish, t_finish, step)
        for t in trained:
            self.staleness_log.append(t.staleness)
            self.trained_group_ids.append(t.slot.group_id)
        self.waiting_on = f"refit to version {self.trainer.version}"
        refit_metrics = await self.refitter.refit(self.trainer.version)
        self.timeline.add("refit", step, t_finish, time.monotonic(), self.trainer.version)
        await self._abort_stale(self.trainer.version)
        self.idle_s += batch.idle
        metrics = step_metrics(self.ledger, step, trained, train_metrics, refit_metrics, t_step0, batch.idle,
                               step_pairs=self.step_pairs, policy_frozen=self.policy_frozen,
                               buffer_live=self.buffer.live(), gc_clock=self.gc_clock)
        # in_order: async/* bounds; adaptive: decides the bound of versions > step
        metrics.update(self.sampler.observe(step, metrics))
        if self.sampler.carry_bound is not None:  # partial rollouts
            metrics["async/carried_groups"] = float(sum(1 for t in trained if t.slot.carried))
            metrics["async/carried_groups_total"] = float(self.carried_groups)
        if self.on_step is not None:
            self.waiting_on = f"step hook (metrics/validation) after step {step}"
            await self.on_step(step, metrics, trained)
        if self.on_checkpoint is not None:
            self.waiting_on = f"checkpoint after step {step}"
            await self.on_checkpoint(self.trainer.version)
        await self.clock.publish(self.trainer.version)
        return metrics

    async def _abort_stale(self, version: int) -> None:
        """Have the rollout pump abort the in-flight groups the sampler declares stale at `version`
        (frees the engine at once): asked through the ledger where a reserved slot is stale, and
        waited for, so the step's metrics count them."""
        if not any(self.sampler.should_abort_inflight(s, version) for s in self.buffer.reserved()):
            return
        ledger = self.ledger
        ledger.stale_at = version
        await notify(self.cond)
        await wait_until(self.cond, lambda: ledger.stale_served >= version or ledger.failure is not None)

    # ------------------------------------------------------------------ training with retries

    def _split(self, chunk: TrainChunk, num_groups: int, groups_per_chunk: int) -> list[TrainChunk]:
        """Fixed chunk boundaries (reproducible runs): `groups_per_chunk` groups per chunk."""
        n = self.cfg.grpo.num_generations_per_prompt
        rows = chunk.num_samples
        step = groups_per_chunk * n
        return [chunk.slice(i, min(i + step, rows)) for i in range(0, rows, step)]

    async def _train_chunks(self, step: int, all_chunks: list[TrainChunk], streamed: list[TrainChunk]) -> None:
        """Feed chunks into the open step; on a failure, abort and replay every chunk of the step."""
        try:
            if not self._open:
                self.trainer.begin(self.loss)
                self._open = True
            if self.policy_frozen:  # critic warm-up: no policy update this step
                return
            for c in streamed:
                await asyncio.to_thread(self.trainer.train_microbatches, c)
        except Exception as exc:  # noqa: BLE001 - transient failures are retried below
            await self._retry(step, all_chunks, exc)

    async def _finish(self, step: int, chunks: list[TrainChunk], advance_version: bool = True) -> dict:
        """The optimizer update closing the open trainer step. A failure (e.g. non-finite gradients:
        `FloatingPointError`) reopens the step, replays `chunks` and tries the update again, as long
        as the RL step's retry budget lasts; then `TrainStepFailed` with no trainer step left open."""
        while True:
            try:
                out = await asyncio.to_thread(self.trainer.finish, advance_version)
            except Exception as exc:  # noqa: BLE001 - transient failures are retried; _retry raises at the end
                await self._retry(step, chunks, exc)
                continue
            self._open = False
            if advance_version:  # the policy has trained on the step's groups: a later failure must not return them
                self._open_slots = []
            return out

    def _close_step(self) -> None:
        """Leave no trainer step open (after a failure)."""
        self.trainer.abort()
        self._open = False

    async def _retry(self, step: int, chunks: list[TrainChunk], exc: Exception) -> None:
        """Reopen the trainer step and replay `chunks` after `exc`, using the RL step's retries
        (`async_rl.failure.max_train_step_retries`, shared by every failure of the policy update in
        one RL step, PPO mini-steps included); a replay that fails again uses the next retry."""
        budget = self.cfg.async_rl.failure.max_train_step_retries
        last = exc
        while self._step_retries < budget:
            self._step_retries += 1
            self.stats.train_retries += 1
            self._close_step()
            try:
                self.trainer.begin(self.loss)
                self._open = True
                if not self.policy_frozen:
                    for c in chunks:
                        await asyncio.to_thread(self.trainer.train_microbatches, c)
                return
            except Exception as again:  # noqa: BLE001
                last = again
        self._close_step()
        raise TrainStepFailed(f"RL step {step} failed {budget + 1} times (async_rl.failure.max_train_step_retries="
                              f"{budget}); last error: {type(last).__name__}: {last}") from last

    async def _retried(self, what: str, attempt: Callable[[], Awaitable], cleanup: Callable[[], None] | None = None):
        """Run `attempt()` and retry it up to `max_train_step_retries` times (`cleanup()` after each
        failure): the logprob, value and critic-update passes of a step. Used up: the open trainer
        step is closed and `TrainStepFailed` stops the run (with a checkpoint)."""
        budget = self.cfg.async_rl.failure.max_train_step_retries
        for i in range(budget + 1):
            try:
                return await attempt()
            except Exception as exc:  # noqa: BLE001 - transient failures are retried
                last = exc
                if cleanup is not None:
                    cleanup()
                if i < budget:
                    self.stats.train_retries += 1
                    self.stats.pass_retries += 1
        if self._open:
            self._close_step()
        raise TrainStepFailed(f"{what} of RL step {self.current_step} failed {budget + 1} times "
                              f"(async_rl.failure.max_train_step_retries={budget}); last error: "
                              f"{type(last).__name__}: {last}") from last

    async def _pass(self, what: str, fn: Callable, *args):
        """A forward-only pass (logprobs, critic values) in a worker thread, with retries."""
        return await self._retried(what, lambda: asyncio.to_thread(fn, *args))

    async def _critic_step(self, chunks: list[TrainChunk], advance: bool) -> dict:
        """One critic optimizer step on the chunks' returns (clipped value loss), with retries."""
        async def attempt() -> dict:
            self.critic.begin()
            for c in chunks:
                await asyncio.to_thread(self.critic.train_microbatches, c)
            return await asyncio.to_thread(self.critic.finish, advance)

        out = await self._retried("the critic update", attempt, cleanup=self.critic.abort)
        return {f"critic/{k}": v for k, v in out.items()}

    async def _mini_steps(self, step: int, full: TrainChunk, trained: list[TrainedGroup],
                          resume: OpenStep | None) -> dict:
        """ppo_epochs x num_minibatches optimizer steps over the step's batch (policy and critic),
        previous-policy logprobs fixed before the first one (Schulman et al. 2017, PPO,
        Algorithm 1). Between two mini-steps `on_ministep` may checkpoint the open step;
        `resume` continues one."""
        if resume is not None:
            start = resume.next_ministep
            served = resume.served_weights
        else:
            if needs_prev_logprobs(self.cfg):
                full.prev_logprobs = await self._pass("previous-policy logprobs", self.trainer.logprobs, full)
            start = 0
            # the generation side keeps serving this step's starting weights until refit: a checkpoint
            # between mini-steps must hold them too (the trainer's weights move on)
            served = ({k: v.detach().clone() for k, v in self.trainer.export_weights().items()}
                      if self.on_ministep is not None and self.cfg.checkpoint.save_every_optimizer_steps else None)
        n = full.num_samples
        mb = self.cfg.grpo.num_minibatches
        total = self.cfg.grpo.ppo_epochs * mb
        sums: dict[str, float] = dict(resume.metric_sums) if resume is not None else {}
        counts: dict[str, int] = dict(resume.metric_counts) if resume is not None else {}
        for k_mini in range(start, total):
            epoch, j = divmod(k_mini, mb)
            order = list(range(n))
            random.Random(f"ppo:{self.cfg.grpo.seed}:{step}:{epoch}").shuffle(order)
            sub = full.take(torch.tensor(sorted(order[j * n // mb:(j + 1) * n // mb]), dtype=torch.long))
            last = k_mini == total - 1
            await self._train_chunks(step, [sub], streamed=[sub])
            out = await self._finish(step, [sub], advance_version=last)
            if self.critic is not None:
                out.update(await self._critic_step([sub], advance=last))
            for k, v in out.items():  # mean over the mini-steps that reported each metric
                sums[k] = sums.get(k, 0.0) + v
                counts[k] = counts.get(k, 0) + 1
            if not last:
                self._open_step = OpenStep(step=step, next_ministep=k_mini + 1, trained=trained, chunk=full,
                                           served_weights=served, metric_sums=dict(sums), metric_counts=dict(counts))
                if self.on_ministep is not None:
                    await self.on_ministep(self._open_step)
        metrics = {k: sums[k] / counts[k] for k in sums}
        metrics["optimizer_steps_in_rl_step"] = float(total)
        return metrics
