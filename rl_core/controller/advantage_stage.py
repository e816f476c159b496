"""The advantage stage of the train pump: selected groups -> a training chunk with advantages.

Owns, per chunk of selected groups, in this order: the dynamic-sampling group filter
(zero-variance groups are set aside so the step can be refilled), packing the samples
(`packing.make_group_chunk`; every group is read through its columns, `columns.group_columns`),
reference-policy logprobs when the reward carries a KL term, the critic's values (PPO)
(both passes run through the pump's `run_pass`, which retries them),
`algorithms.estimate.estimate_advantages` for every estimator, and the per-sample advantage
summary kept for metrics and the rollout archive.

Does not own: the formulas (rl_core.algorithms), selection (sampler), training (trainer,
critic), or refilling the step (the train pump asks the rollout pump).
"""

from __future__ import annotations

import asyncio
import operator
from dataclasses import dataclass, field
from itertools import repeat
from typing import Awaitable, Callable

import torch

from rl_core.algorithms.estimate import estimate_advantages
from rl_core.algorithms.shaping import dynamic_sampling_filter
from rl_core.packing import make_group_chunk
from rl_core.types import PromptGroup, TrainChunk
from rl_core.columns import group_columns


@dataclass
class Stage:
    chunk: TrainChunk
    groups: list[PromptGroup]
    advantages: list[list[float]]  # per group, one value per sample (token mean for token-level estimators)
    metrics: dict[str, tuple[float, float]] = field(default_factory=dict)


class AdvantageStage:
    def __init__(self, cfg, trainer, critic, pad_id: int, run_pass: Callable[..., Awaitable] | None = None):
        self.cfg = cfg
        # run_pass(what, fn, *args): runs a forward pass in a worker thread; the train pump's retries it
        self.run_pass = run_pass or (lambda what, fn, *args: asyncio.to_thread(fn, *args))
        self.trainer = trainer
        self.critic = critic
        self.pad_id = pad_id
        ds = cfg.reward_shaping.dynamic_sampling
        self.dynamic_sampling = ds.enabled
        self.gdpo = cfg.advantage.estimator == "gdpo"

    def filter(self, groups: list[PromptGroup]) -> tuple[list[bool], dict]:
        """Dynamic sampling (Yu et al. 2025, DAPO): keep only groups whose rewards differ."""
        if not self.dynamic_sampling:
            return [True] * len(groups), {}
        return dynamic_sampling_filter(groups, use_components=self.gdpo)

    async def build(self, groups: list[PromptGroup]) -> Stage:
        cols = [group_columns(g.samples) for g in groups]  # each group's columns, read by everything below
        chunk = make_group_chunk(cols, pad_id=self.pad_id, require_routes=self.cfg.trainer.router_replay.enabled)
        # no completion masks: a 0/1 loss mask
        binary = all(c.completion_masks is None for c in cols)
        # per sample, in chunk order
        rewards: list[float] = []
        # the samples that enter the statistics: read only with advantage.exclude_invalid_from_stats
        valid: list[bool] | None = [] if self.cfg.advantage.exclude_invalid_from_stats else None
        # which samples were cut at max_tokens: only bootstrapping truncated samples (gae) reads it
        truncated: list[bool] | None = [] if self.cfg.advantage.bootstrap_truncated else None
        components: list | None = [] if self.gdpo else None
        sizes = [len(c.rewards) for c in cols]  # samples per group
        for c in cols:
            rewards += c.rewards
            fin = c.finish_reasons
            if valid is not None:
                masked = c.env_mask
                if any(masked) or "abort" in fin:
                    valid += [not m and f != "abort" for m, f in zip(masked, fin)]
                else:  # the usual case, without a loop per sample
                    valid += [True] * len(fin)
            if truncated is not None:
                truncated += map(operator.eq, fin, repeat("length"))  # [f == "length" for f in fin], in C
            if components is not None:
                components += c.component_columns.rows()
        ref = None
        if self.cfg.advantage.kl_in_reward_coef > 0:
            ref = await self.run_pass("reference logprobs", self.trainer.logprobs, chunk, True)
            chunk.ref_logprobs = ref
        adv_cfg = self.cfg.advantage
        values = final = None
        if self.critic is not None:
            if adv_cfg.bootstrap_truncated:
                values, final = await self.run_pass("critic values", self.critic.values, chunk, True)
            else:
                values = await self.run_pass("critic values", self.critic.values, chunk)
        est = estimate_advantages(
            adv_cfg, chunk, rewards, sizes, components=components, ref_logprobs=ref,
            values=values, valid=valid, truncated=truncated, final_values=final, binary_loss_mask=binary)
        chunk.advantages = est.advantages
        chunk.values = values
        chunk.returns = est.returns
        if est.sample_advantages is not None:
            flat = est.sample_advantages.tolist()
        else:  # token-level estimators: the mean over each sample's trained tokens
            m = chunk.loss_mask
            flat = ((est.advantages * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)).tolist()
        per_group, start = [], 0
        for k in sizes:
            per_group.append(flat[start:start + k])
            start += k
        return Stage(chunk, groups, per_group, dict(est.metrics))


