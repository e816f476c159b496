"""The train pump: buffer -> sampler -> advantages -> trainer (split step API) -> refit.

Owns: the RL step loop (one step = one `finish()`), streaming chunks of ready groups into
the trainer as the sampler releases them (or, in reproducible runs, fixed-size chunks in
dispatch order once the whole step is ready), advantage computation per chunk, per-step
metrics (reward, accuracy, advantages, loss, staleness, timings, idle time, tokens/s),
and the order of the step's end: finish -> refit -> step hook (metrics, validation,
rollout archive) -> checkpoint hook (quiescent) -> publish the new version.

Does not own: which groups are eligible (sampler), generation (rollout pump), how
weights move (refit.py), or what a checkpoint holds. Trainer calls run in a worker thread
so the event loop (and the rollout pump with it) keeps running while the trainer computes.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from rl_core.algorithms.advantages import compute_advantages
from rl_core.buffer.replay_buffer import ReplayBuffer, Slot, SlotState
from rl_core.controller.events import Timeline, VersionClock, wait_until
from rl_core.rollout.group import is_correct
from rl_core.types import PromptGroup, make_train_chunk


@dataclass
class TrainedGroup:
    slot: Slot
    group: PromptGroup
    advantages: list[float]
    staleness: int  # trainer version at train time - weight version at dispatch


StepHook = Callable[[int, dict, list[TrainedGroup]], Awaitable[None]]


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
        self.reproducible = cfg.async_rl.reproducible
        self.waiting_on = "not started"
        self.idle_s = 0.0
        self.trained_group_ids: list[str] = []
        self.staleness_log: list[int] = []

    async def run(self) -> None:
        while self.trainer.version < self.stop_step:
            await self.train_step(self.trainer.version)
        self.waiting_on = "done"

    def _ready_for_step(self, want: int) -> Callable[[], bool]:
        def pred() -> bool:
            if self.rollout.exhausted or self.rollout._failure is not None:
                return True
            return len(self.sampler.select(self.buffer.ready(), self.trainer.version, want)) >= want
        return pred

    async def _next_chunk(self, step: int, got: int) -> list[Slot]:
        per_step = self.cfg.grpo.num_prompts_per_step
        m = self.cfg.async_rl.min_groups_for_streaming_train
        want = per_step - got if self.reproducible else min(m, per_step - got)
        while True:
            self.waiting_on = f"{want} ready group(s) for step {step} (have {got}/{per_step})"
            await wait_until(self.cond, self._ready_for_step(want))
            slots = self.sampler.select(self.buffer.ready(), self.trainer.version, per_step - got)
            if len(slots) >= want:
                if self.reproducible:  # fixed chunk boundaries, in dispatch order
                    slots = sorted(slots, key=lambda s: s.dispatch_index)[:min(m, per_step - got)]
                return slots
            if self.rollout._failure is not None:
                raise self.rollout._failure
            if self.rollout.exhausted:
                raise RuntimeError(f"rollouts ended with step {step} incomplete ({got}/{per_step} groups)")

    async def train_step(self, step: int) -> dict:
        per_step = self.cfg.grpo.num_prompts_per_step
        t_step0 = time.monotonic()
        got, idle, trained = 0, 0.0, []
        t_train0 = None
        if self.reproducible:  # the whole step must be ready before the first chunk
            t0 = time.monotonic()
            self.waiting_on = f"all {per_step} groups of step {step}"
            await wait_until(self.cond, self._ready_for_step(per_step))
            idle += time.monotonic() - t0
        while got < per_step:
            t0 = time.monotonic()
            slots = await self._next_chunk(step, got)
            idle += time.monotonic() - t0
            await self.buffer.finish(slots, SlotState.SELECTED)
            groups = [s.group for s in slots]
            advs = compute_advantages(self.cfg.advantage, [g.rewards for g in groups])
            chunk = make_train_chunk([smp for g in groups for smp in g.samples], [a for ga in advs for a in ga],
                                     pad_id=self.pad_id)
            if t_train0 is None:
                self.trainer.begin(self.loss)
                t_train0 = time.monotonic()
            self.waiting_on = f"trainer (step {step}, chunk of {len(slots)} groups)"
            await asyncio.to_thread(self.trainer.train_microbatches, chunk)
            for s, g, a in zip(slots, groups, advs):
                trained.append(TrainedGroup(s, g, a, step - s.start_version))
                self.staleness_log.append(step - s.start_version)
                self.trained_group_ids.append(s.group_id)
            got += len(slots)
        self.waiting_on = f"trainer finish (step {step})"
        train_metrics = await asyncio.to_thread(self.trainer.finish)
        t_finish = time.monotonic()
        self.timeline.add("train", step, t_train0, t_finish, step)
        self.waiting_on = f"refit to version {self.trainer.version}"
        refit_metrics = await self.refitter.refit(self.trainer.version)
        self.timeline.add("refit", step, t_finish, time.monotonic(), self.trainer.version)
        self.idle_s += idle
        metrics = self._metrics(step, trained, train_metrics, refit_metrics, t_step0, idle)
        if self.on_step is not None:
            self.waiting_on = f"step hook (metrics/validation) after step {step}"
            await self.on_step(step, metrics, trained)
        if self.on_checkpoint is not None:
            self.waiting_on = f"checkpoint after step {step}"
            await self.on_checkpoint(self.trainer.version)
        await self.clock.publish(self.trainer.version)
        return metrics

    def _metrics(self, step, trained: list[TrainedGroup], train_metrics, refit_metrics, t_step0, idle) -> dict:
        samples = [smp for t in trained for smp in t.group.samples]
        rewards = [smp.reward for smp in samples]
        advs = [a for t in trained for a in t.advantages]
        stal = [t.staleness for t in trained]
        lengths = [len(smp.completion_ids) for smp in samples]
        step_s = time.monotonic() - t_step0
        m = {
            "train/reward_mean": statistics.fmean(rewards),
            "train/accuracy": statistics.fmean(1.0 if is_correct(s) else 0.0 for s in samples),
            "train/advantage_mean": statistics.fmean(advs),
            "train/advantage_abs_mean": statistics.fmean(abs(a) for a in advs),
            "train/advantage_std": statistics.pstdev(advs),
            "train/zero_variance_groups": sum(1 for t in trained if len(set(t.group.rewards)) == 1) / len(trained),
            "train/completion_len_mean": statistics.fmean(lengths),
            "train/truncation_rate": statistics.fmean(1.0 if s.truncated else 0.0 for s in samples),
            "staleness/mean": statistics.fmean(stal),
            "staleness/max": max(stal),
            "timing/step_s": step_s,
            "timing/train_idle_s": idle,
            "timing/rollout_idle_s_total": self.rollout.stats.idle_s,
            "throughput/trained_tokens_per_s": sum(lengths) / step_s if step_s > 0 else 0.0,
            "epoch": max(t.group.epoch for t in trained),
        }
        for k, v in train_metrics.items():
            m[f"train/{k}"] = v
        for k, v in refit_metrics.items():
            m[f"refit/{k}"] = v
        return m
