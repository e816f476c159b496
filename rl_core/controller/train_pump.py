"""The train pump: buffer -> sampler -> advantages -> trainer (split step API) -> refit.

Owns: the RL step loop (one RL step = one weight version; it may hold several optimizer
steps: `ppo_epochs` x `num_minibatches`, counted apart), the step quota (a step shrinks by
the groups the rollout pump dropped for it), eviction of groups the sampler rejects,
streaming chunks of ready groups into the trainer as the sampler releases them (or the
whole step at once: reproducible runs, PPO mini-steps), advantage computation, the
loss-driven refresh of previous-policy logprobs, bounded retries of a step whose training
failed transiently, per-step metrics, and the order of the step's end: finish -> refit ->
abort stale in-flight groups -> step hook (metrics, validation, rollout archive) ->
checkpoint hook (quiescent) -> publish the new version.

Does not own: which groups are eligible (sampler), generation (rollout pump), how weights
move (refit.py), checkpoint contents (controller). Trainer calls run in a worker thread so
the event loop (and the rollout pump with it) keeps running while the trainer computes.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from rl_core.algorithms.advantages import compute_advantages
from rl_core.buffer.replay_buffer import ReplayBuffer, Slot, SlotState
from rl_core.controller.events import Timeline, VersionClock, wait_until
from rl_core.controller.step_metrics import step_metrics
from rl_core.types import PromptGroup, TrainChunk, make_train_chunk


@dataclass
class TrainedGroup:
    slot: Slot
    group: PromptGroup
    advantages: list[float]
    staleness: int  # trainer version at train time - weight version at dispatch


class TrainStepFailed(RuntimeError):
    """Training of one RL step kept failing after its retries; the run stops (with a checkpoint)."""


StepHook = Callable[[int, dict, list[TrainedGroup]], Awaitable[None]]


def needs_prev_logprobs(cfg) -> bool:
    """Previous-policy logprobs must be computed before training only when an RL step holds
    several optimizer steps: otherwise they equal the current logprobs (detached)."""
    return cfg.grpo.ppo_epochs * cfg.grpo.num_minibatches > 1


def needs_reference_logprobs(cfg) -> bool:
    """Reference-policy logprobs are needed only for a KL penalty to the reference."""
    return cfg.loss.kl_coef > 0 or bool(getattr(cfg.loss, "kl_in_reward", False))


class TrainPump:
    def __init__(self, *, cfg, sampler, buffer: ReplayBuffer, trainer, loss, refitter, clock: VersionClock,
                 cond: asyncio.Condition, timeline: Timeline, rollout, stop_step: int, pad_id: int,
                 on_step: StepHook | None = None, on_checkpoint: Callable[[int], Awaitable[None]] | None = None):
        self.cfg = cfg
        self.sampler = sampler
        self.buffer = buffer
        self.trainer = trainer
        self.loss = loss
        self.refitter = refitter
        self.clock = clock
        self.cond = cond
        self.timeline = timeline
        self.rollout = rollout
        self.stop_step = stop_step
        self.pad_id = pad_id
        self.on_step = on_step
        self.on_checkpoint = on_checkpoint
        self.per_step = cfg.grpo.num_prompts_per_step
        self.mini_steps = cfg.grpo.ppo_epochs * cfg.grpo.num_minibatches
        self.whole_step = cfg.async_rl.reproducible or self.mini_steps > 1
        self.waiting_on = "not started"
        self.idle_s = 0.0
        self.selected_in_step = 0  # groups of the open step already taken from the buffer
        self.evicted_groups = 0
        self.train_retries = 0
        self.stale_aborted_groups = 0
        self._open = False  # a trainer step is open (begin called, finish not yet)
        self._open_slots: list[Slot] = []  # groups taken for the step in progress
        self.current_step = trainer.version
        self.trained_group_ids: list[str] = []
        self.staleness_log: list[int] = []

    # ------------------------------------------------------------------ loop

    def quota(self, step: int) -> int:
        """Groups step `step` trains: fewer when the rollout pump dropped some of its groups."""
        if self.sampler.stamps:
            return self.per_step - self.rollout.dropped_per_step.get(step, 0)
        return self.per_step

    def demand(self) -> int:
        """Groups the trainer may still consume before `stop_step` (drives unstamped dispatch).
        Counted from the pump's own step counter: the trainer's version changes inside a worker
        thread, before the pump has reset its per-step count."""
        return max(0, (self.stop_step - self.current_step) * self.per_step - self.selected_in_step)

    async def run(self) -> None:
        while self.trainer.version < self.stop_step:
            await self.train_step(self.trainer.version)
        self.waiting_on = "done"

    async def _evict(self) -> None:
        gone = self.sampler.evict(self.buffer, self.trainer.version)
        if gone:
            self.evicted_groups += len(gone)
            self.rollout.stats.wasted_samples += sum(len(s.group.samples) for s in gone if s.group)
            await self.buffer.finish(gone, SlotState.EVICTED)

    async def _take(self, step: int, want: int, most: int) -> list[Slot]:
        """Wait until at least `want` groups are selectable (or the quota shrinks), then take up to `most`."""
        while True:
            await self._evict()
            slots = self.sampler.select(self.buffer, self.trainer.version, most)
            need = min(want, self.quota(step) - self.selected_in_step)
            if len(slots) >= need:
                if self.whole_step or self.cfg.async_rl.reproducible:
                    slots = sorted(slots, key=lambda s: s.dispatch_index)
                slots = slots[:most]
                await self.buffer.finish(slots, SlotState.SELECTED)
                self.selected_in_step += len(slots)
                self._open_slots.extend(slots)
                return slots
            if self.rollout._failure is not None:
                raise self.rollout._failure
            if self.rollout.exhausted:
                raise RuntimeError(f"rollouts ended with step {step} incomplete "
                                   f"({self.selected_in_step}/{self.quota(step)} groups)")
            self.waiting_on = (f"{need} ready group(s) for step {step} "
                               f"(have {self.selected_in_step}/{self.quota(step)})")
            snapshot = (len(self.buffer.ready()), self.quota(step), self.rollout.exhausted, self.trainer.version)
            await wait_until(self.cond, lambda: self.rollout._failure is not None or snapshot != (
                len(self.buffer.ready()), self.quota(step), self.rollout.exhausted, self.trainer.version))

    def _chunk(self, slots: list[Slot]) -> tuple[list[PromptGroup], list[list[float]], TrainChunk]:
        groups = [s.group for s in slots]
        advs = compute_advantages(self.cfg.advantage, [g.rewards for g in groups])
        chunk = make_train_chunk([smp for g in groups for smp in g.samples], [a for ga in advs for a in ga],
                                 pad_id=self.pad_id)
        return groups, advs, chunk

    async def train_step(self, step: int) -> dict:
        t_step0 = time.monotonic()
        self.current_step = step
        self.selected_in_step = 0
        self._open_slots = []
        trained: list[TrainedGroup] = []
        chunks: list[TrainChunk] = []
        idle = 0.0
        t_train0 = None
        m = self.cfg.async_rl.min_groups_for_streaming_train
        while self.selected_in_step < self.quota(step):
            remaining = self.quota(step) - self.selected_in_step
            want = remaining if self.whole_step else min(m, remaining)
            t0 = time.monotonic()
            slots = await self._take(step, want, remaining if self.whole_step else remaining)
            idle += time.monotonic() - t0
            groups, advs, chunk = self._chunk(slots)
            for s, g, a in zip(slots, groups, advs):
                trained.append(TrainedGroup(s, g, a, step - s.start_version))
            if t_train0 is None:
                t_train0 = time.monotonic()
            if self.mini_steps == 1:
                chunks.extend(self._split(chunk, len(slots), m) if self.whole_step else [chunk])
                if not self.whole_step:
                    await self._train_chunks(step, chunks, streamed=[chunks[-1]])
        self.waiting_on = f"trainer (step {step})"
        if self.mini_steps > 1:
            train_metrics = await self._mini_steps(step, chunks or [make_train_chunk(
                [smp for t in trained for smp in t.group.samples], [a for t in trained for a in t.advantages],
                pad_id=self.pad_id)])
        else:
            if self.whole_step:
                await self._train_chunks(step, chunks, streamed=chunks)
            train_metrics = await self._finish(step, chunks)
        t_finish = time.monotonic()
        self.current_step, self.selected_in_step = step + 1, 0  # demand() now counts from the next step
        self._open_slots = []
        self.timeline.add("train", step, t_train0 or t_finish, t_finish, step)
        for t in trained:
            self.staleness_log.append(t.staleness)
            self.trained_group_ids.append(t.slot.group_id)
        self.waiting_on = f"refit to version {self.trainer.version}"
        refit_metrics = await self.refitter.refit(self.trainer.version)
        self.timeline.add("refit", step, t_finish, time.monotonic(), self.trainer.version)
        self.stale_aborted_groups += await self.rollout.abort_stale(self.trainer.version)
        self.idle_s += idle
        metrics = step_metrics(self, step, trained, train_metrics, refit_metrics, t_step0, idle)
        if self.on_step is not None:
            self.waiting_on = f"step hook (metrics/validation) after step {step}"
            await self.on_step(step, metrics, trained)
        if self.on_checkpoint is not None:
            self.waiting_on = f"checkpoint after step {step}"
            await self.on_checkpoint(self.trainer.version)
        await self.clock.publish(self.trainer.version)
        return metrics

    async def return_open_step(self) -> None:
        """Put the groups of a failed, unfinished step back into the buffer as ready."""
        await self.buffer.restore_ready(self._open_slots)
        self._open_slots = []
        self.selected_in_step = 0

    # ------------------------------------------------------------------ training with retries

    def _split(self, chunk: TrainChunk, num_groups: int, groups_per_chunk: int) -> list[TrainChunk]:
        """Fixed chunk boundaries (reproducible runs): `groups_per_chunk` groups per chunk."""
        n = self.cfg.grpo.num_generations_per_prompt
        step = groups_per_chunk * n
        return [chunk.slice(i, min(i + step, num_groups * n)) for i in range(0, num_groups * n, step)]

    async def _train_chunks(self, step: int, all_chunks: list[TrainChunk], streamed: list[TrainChunk]) -> None:
        """Feed chunks into the open step; on a failure, abort and replay every chunk of the step."""
        try:
            if not self._open:
                self.trainer.begin(self.loss)
                self._open = True
            for c in streamed:
                await asyncio.to_thread(self.trainer.train_microbatches, c)
        except Exception as exc:  # noqa: BLE001 - transient failures are retried below
            await self._retry(step, all_chunks, exc)

    async def _finish(self, step: int, chunks: list[TrainChunk], advance_version: bool = True) -> dict:
        try:
            out = await asyncio.to_thread(self.trainer.finish, advance_version)
        except Exception as exc:  # noqa: BLE001
            await self._retry(step, chunks, exc)
            out = await asyncio.to_thread(self.trainer.finish, advance_version)
        self._open = False
        return out

    async def _retry(self, step: int, chunks: list[TrainChunk], exc: Exception) -> None:
        budget = self.cfg.async_rl.failure.max_train_step_retries
        last = exc
        for attempt in range(1, budget + 1):
            self.train_retries += 1
            self.trainer.abort()
            try:
                self.trainer.begin(self.loss)
                self._open = True
                for c in chunks:
                    await asyncio.to_thread(self.trainer.train_microbatches, c)
                return
            except Exception as again:  # noqa: BLE001
                last = again
        self.trainer.abort()
        self._open = False
        raise TrainStepFailed(f"RL step {step} failed {budget + 1} times (async_rl.failure.max_train_step_retries="
                              f"{budget}); last error: {type(last).__name__}: {last}") from last

    async def _mini_steps(self, step: int, chunks: list[TrainChunk]) -> dict:
        """ppo_epochs x num_minibatches optimizer steps over the step's batch, previous-policy
        logprobs fixed before the first one (Schulman et al. 2017, PPO, Algorithm 1)."""
        import torch

        full = chunks[0] if len(chunks) == 1 else _concat(chunks, self.pad_id)
        if needs_prev_logprobs(self.cfg):
            full.prev_logprobs = await asyncio.to_thread(self.trainer.logprobs, full)
        n = full.num_samples
        mb = self.cfg.grpo.num_minibatches
        metrics: dict = {}
        count = 0
        for epoch in range(self.cfg.grpo.ppo_epochs):
            order = list(range(n))
            random.Random(f"ppo:{self.cfg.grpo.seed}:{step}:{epoch}").shuffle(order)
            for j in range(mb):
                idx = torch.tensor(sorted(order[j * n // mb:(j + 1) * n // mb]), dtype=torch.long)
                sub = _take_rows(full, idx)
                last = epoch == self.cfg.grpo.ppo_epochs - 1 and j == mb - 1
                await self._train_chunks(step, [sub], streamed=[sub])
                out = await self._finish(step, [sub], advance_version=last)
                count += 1
                for k, v in out.items():
                    metrics[k] = metrics.get(k, 0.0) + (v - metrics.get(k, 0.0)) / count  # running mean
        metrics["optimizer_steps_in_rl_step"] = float(count)
        return metrics


def _take_rows(chunk: TrainChunk, idx) -> TrainChunk:
    def pick(t):
        return None if t is None else t.index_select(0, idx)

    out = TrainChunk(**{k: pick(getattr(chunk, k)) for k in chunk.__dataclass_fields__})
    return out.slice(0, out.num_samples)  # trims shared right padding


def _concat(chunks: list[TrainChunk], pad_id: int) -> TrainChunk:
    import torch

    width = max(c.input_ids.shape[1] for c in chunks)

    def cat(name, fill):
        ts = [getattr(c, name) for c in chunks]
        if any(t is None for t in ts):
            return None
        if ts[0].dim() == 1:
            return torch.cat(ts)
        return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill) for t in ts])

    return TrainChunk(input_ids=cat("input_ids", pad_id), attention_mask=cat("attention_mask", 0),
                      loss_mask=cat("loss_mask", 0.0), gen_logprobs=cat("gen_logprobs", 0.0),
                      advantages=cat("advantages", 0.0), sample_mask=cat("sample_mask", 0.0),
                      start_versions=cat("start_versions", 0), ref_logprobs=cat("ref_logprobs", 0.0),
                      prev_logprobs=cat("prev_logprobs", 0.0))
