"""The train pump: buffer -> sampler -> advantages -> trainer (split step API) -> refit.

Owns: the RL step loop (one step = one `finish()`), streaming chunks of ready groups into
the trainer as the sampler releases them, advantage computation per chunk, per-step
metrics (reward, accuracy, advantages, loss, staleness, timings, idle time, tokens/s),
handing the new weights to the refitter, and publishing the new version.

Does not own: which groups are eligible (sampler), generation (rollout pump), or how
weights move (refit.py). Trainer calls run in a worker thread so the event loop (and with
it the rollout pump) keeps running while the trainer computes.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Callable

from rl_core.algorithms.advantages import compute_advantages
from rl_core.buffer.replay_buffer import ReplayBuffer, SlotState
from rl_core.controller.events import Timeline, VersionClock, wait_until
from rl_core.rollout.group import is_correct
from rl_core.types import make_train_chunk


class TrainPump:
    def __init__(self, *, cfg, sampler, buffer: ReplayBuffer, trainer, loss, refitter, clock: VersionClock,
                 cond: asyncio.Condition, timeline: Timeline, rollout, total_steps: int, pad_id: int,
                 on_step: Callable[[int, dict], "asyncio.Future | None"] | None = None):
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
        self.total_steps = total_steps
        self.pad_id = pad_id
        self.on_step = on_step
        self.waiting_on = "not started"
        self.idle_s = 0.0
        self.trained_group_ids: list[str] = []
        self.staleness_log: list[int] = []

    async def run(self) -> None:
        while self.trainer.version < self.total_steps:
            step = self.trainer.version
            metrics = await self.train_step(step)
            if self.on_step is not None:
                await self.on_step(step, metrics)
        self.waiting_on = "done"

    def _selectable(self, want: int) -> Callable[[], bool]:
        def pred() -> bool:
            if self.rollout.exhausted or self.rollout._failure is not None:
                return True
            return len(self.sampler.select(self.buffer.ready(), self.trainer.version, want)) >= want
        return pred

    async def train_step(self, step: int) -> dict:
        acfg = self.cfg.async_rl
        per_step = self.cfg.grpo.num_prompts_per_step
        t_step0 = time.monotonic()
        got, begun = 0, False
        groups = []
        idle = 0.0
        t_train0 = None
        while got < per_step:
            want = min(acfg.min_groups_for_streaming_train, per_step - got)
            self.waiting_on = f"{want} ready group(s) for step {step} (have {got}/{per_step})"
            t0 = time.monotonic()
            await wait_until(self.cond, self._selectable(want))
            idle += time.monotonic() - t0
            slots = self.sampler.select(self.buffer.ready(), self.trainer.version, per_step - got)
            if len(slots) < want:
                if self.rollout._failure is not None:
                    raise self.rollout._failure
                if self.rollout.exhausted:
                    raise RuntimeError(f"rollouts ended with step {step} incomplete ({got}/{per_step} groups)")
                continue
            await self.buffer.finish(slots, SlotState.SELECTED)
            chunk_groups = [s.group for s in slots]
            for s in slots:
                self.staleness_log.append(step - s.start_version)
                self.trained_group_ids.append(s.group_id)
            advs = compute_advantages(self.cfg.advantage, [g.rewards for g in chunk_groups])
            samples = [smp for g in chunk_groups for smp in g.samples]
            flat_adv = [a for ga in advs for a in ga]
            chunk = make_train_chunk(samples, flat_adv, pad_id=self.pad_id)
            if not begun:
                self.trainer.begin(self.loss)
                begun = True
                t_train0 = time.monotonic()
            self.waiting_on = f"trainer (step {step}, chunk of {len(slots)} groups)"
            await asyncio.to_thread(self.trainer.train_microbatches, chunk)
            groups.extend(zip(slots, chunk_groups, advs))
            got += len(slots)
        self.waiting_on = f"trainer finish (step {step})"
        train_metrics = await asyncio.to_thread(self.trainer.finish)
        t_finish = time.monotonic()
        self.timeline.add("train", step, t_train0, t_finish, step)
        self.waiting_on = f"refit to version {self.trainer.version}"
        refit_metrics = await self.refitter.refit(self.trainer.version)
        self.timeline.add("refit", step, t_finish, time.monotonic(), self.trainer.version)
        await self.clock.publish(self.trainer.version)
        self.idle_s += idle
        return self._metrics(step, groups, train_metrics, refit_metrics, t_step0, idle)

    def _metrics(self, step, groups, train_metrics, refit_metrics, t_step0, idle) -> dict:
        samples = [smp for _, g, _ in groups for smp in g.samples]
        rewards = [smp.reward for smp in samples]
        advs = [a for _, _, ga in groups for a in ga]
        stal = [step - slot.start_version for slot, _, _ in groups]
        lengths = [len(smp.completion_ids) for smp in samples]
        step_s = time.monotonic() - t_step0
        ntok = sum(lengths)
        m = {
            "train/reward_mean": statistics.fmean(rewards),
            "train/accuracy": statistics.fmean(1.0 if is_correct(s) else 0.0 for s in samples),
            "train/advantage_mean": statistics.fmean(advs),
            "train/advantage_abs_mean": statistics.fmean(abs(a) for a in advs),
            "train/advantage_std": statistics.pstdev(advs),
            "train/zero_variance_groups": sum(1 for _, g, _ in groups if len(set(g.rewards)) == 1) / len(groups),
            "train/completion_len_mean": statistics.fmean(lengths),
            "train/truncation_rate": statistics.fmean(1.0 if s.truncated else 0.0 for s in samples),
            "staleness/mean": statistics.fmean(stal),
            "staleness/max": max(stal),
            "timing/step_s": step_s,
            "timing/train_idle_s": idle,
            "timing/rollout_idle_s_total": self.rollout.stats.idle_s,
            "throughput/trained_tokens_per_s": ntok / step_s if step_s > 0 else 0.0,
            "epoch": max(g.epoch for _, g, _ in groups),
        }
        for k, v in train_metrics.items():
            m[f"train/{k}"] = v
        for k, v in refit_metrics.items():
            m[f"refit/{k}"] = v
        return m
