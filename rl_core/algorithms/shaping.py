"""Reward shaping and filtering: pure functions over samples (or reward tensors), with metrics.

Owns: reward scaling (clamp, then linear map), the DAPO overlong length penalty (saturated,
or unsaturated as verl's `DAPORewardManager` computes it), overlong filtering (truncated
samples leave the loss but stay in their group's baseline), applied in that order by
`shape_group` (the environment's reward kept in `info["unshaped_reward"]`), and the
zero-variance predicate of dynamic sampling. Source: DAPO (Yu et al. 2025, arXiv:2503.14476,
eq. 13 and sec. 3.2).

Does not own: when shaping runs (the rollout pump calls `shape_group` once per group at
commit, so the buffer holds shaped rewards) or refilling a step after groups were dropped
(the train pump, within `dropped_groups_budget`).

Read more: docs/algorithms.md, "Reward shaping" and "Dynamic sampling".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from rl_core.algorithms.metrics import Pair
from rl_core.config.schema import DynamicSamplingConfig, OverlongPenaltyConfig, RewardShapingConfig
from rl_core.types import PromptGroup, Sample
from rl_core.columns import group_columns

UNSHAPED = "unshaped_reward"
PENALTY_COMPONENT = "overlong_penalty"


def overlong_penalty(lengths: torch.Tensor | Sequence[int], max_response_tokens: int, buffer_tokens: int,
                     penalty: float = 1.0, saturate: bool = True) -> torch.Tensor:
    """[B] float64 DAPO length penalty (<= 0) for completions of `lengths` tokens; beyond
    `max_response_tokens` it stays at -penalty (`saturate`) or keeps falling linearly."""
    if not 1 <= buffer_tokens < max_response_tokens:
        raise ValueError(f"buffer_tokens must be in [1, max_response_tokens), got {buffer_tokens} "
                         f"with max_response_tokens {max_response_tokens}")
    n = torch.as_tensor(lengths, dtype=torch.float64)
    start = max_response_tokens - buffer_tokens
    ramp = (start - n) / buffer_tokens
    beyond = -torch.ones_like(n) if saturate else ramp
    out = torch.where(n <= start, torch.zeros_like(n), torch.where(n <= max_response_tokens, ramp, beyond))
    return penalty * out


def overlong_window(cfg: OverlongPenaltyConfig, generation_max_tokens: int) -> tuple[int, int]:
    """(L_max, L_cache) with the config's nulls resolved (L_max = generation.max_tokens, L_cache = L_max // 5)."""
    l_max = cfg.max_response_tokens if cfg.max_response_tokens is not None else generation_max_tokens
    return l_max, cfg.buffer_tokens if cfg.buffer_tokens is not None else l_max // 5


def scale_rewards(rewards: torch.Tensor | Sequence[float], source_min: float, source_max: float,
                  target_min: float, target_max: float) -> torch.Tensor:
    """[B] float64: clamp to [source_min, source_max], then map that range linearly onto [target_min, target_max]."""
    if source_max <= source_min:
        raise ValueError(f"source_max ({source_max}) must exceed source_min ({source_min})")
    r = torch.as_tensor(rewards, dtype=torch.float64).clamp(source_min, source_max)
    return target_min + (r - source_min) * (target_max - target_min) / (source_max - source_min)


@dataclass
class ShapedGroup:
    samples: list[Sample]  # new Sample objects; the input is not modified
    metrics: dict[str, Pair] = field(default_factory=dict)


def shape_group(cfg: RewardShapingConfig, samples: Sequence[Sample], generation_max_tokens: int) -> ShapedGroup:
    """Apply scaling, the overlong penalty and overlong filtering (each when enabled) to one group's samples."""
    n = len(samples)
    raw = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    r = raw.clone()
    sc = cfg.scaling
    if sc.enabled:
        r = scale_rewards(r, sc.source_min, sc.source_max, sc.target_min, sc.target_max)
    pen = torch.zeros(n, dtype=torch.float64)
    op = cfg.overlong_penalty
    if op.enabled:
        l_max, l_cache = overlong_window(op, generation_max_tokens)
        pen = overlong_penalty([len(s.completion_ids) for s in samples], l_max, l_cache, op.penalty, op.saturate)
        r = r + pen
    out = []
    filtered = 0
    for i, s in enumerate(samples):
        info = dict(s.info)
        info[UNSHAPED] = s.reward
        rewards = dict(s.rewards)
        if op.enabled:
            rewards[PENALTY_COMPONENT] = float(pen[i])
        env_mask = s.env_mask
        if cfg.overlong_filtering and s.truncated:
            env_mask = True
            info["overlong_filtered"] = True
            filtered += 1
        out.append(replace(s, reward=float(r[i]), rewards=rewards, env_mask=env_mask, info=info))
    metrics: dict[str, Pair] = {
        "reward_unshaped_mean": (float(raw.sum()), float(n)),
        "reward_shaped_mean": (float(r.sum()), float(n)),
    }
    if cfg.overlong_filtering:
        metrics["overlong_filtered_frac"] = (float(filtered), float(n))
    if op.enabled:
        metrics["overlong_penalty_mean"] = (float(pen.sum()), float(n))
        metrics["overlong_penalized_frac"] = (float((pen < 0).sum()), float(n))
    return ShapedGroup(out, metrics)


def _constant(values: Sequence[float]) -> bool:
    return len(values) == 0 or max(values) == min(values)


def is_zero_variance_group(samples: Sequence[Sample], use_components: bool = False) -> bool:
    """True when the group carries no learning signal: its unshaped rewards are all equal, or
    (use_components, for gdpo) every named reward component is constant across the group."""
    if use_components:
        comps = group_columns(samples).component_columns
        return all(_constant(comps.column(k, 0.0)) for k in sorted(comps.names()))
    return _constant(_unshaped(samples))


def _unshaped(samples: Sequence[Sample]) -> list[float]:
    """The samples' rewards before shaping (`info[UNSHAPED]` where shaping set it, else the reward)."""
    cols = group_columns(samples)
    missing = object()
    return [float(r if u is missing else u) for u, r in zip(cols.info_columns.column(UNSHAPED, missing), cols.rewards)]


def dynamic_sampling_filter(groups: Sequence[PromptGroup],
                            use_components: bool = False) -> tuple[list[bool], dict[str, Pair]]:
    """(keep flag per group, metrics). Metrics: `zero_variance_frac` (dropped / seen) and
    `zero_variance_reward_mean` (mean unshaped reward of the dropped groups: near 1 = too
    easy, near 0 = too hard)."""
    keep, dropped_reward, dropped = [], 0.0, 0
    for g in groups:
        zero = is_zero_variance_group(g.samples, use_components)
        keep.append(not zero)
        if zero:
            dropped += 1
            vals = _unshaped(g.samples)
            dropped_reward += sum(vals) / max(len(vals), 1)
    return keep, {"zero_variance_frac": (float(dropped), float(len(groups))),
                  "zero_variance_reward_mean": (dropped_reward, float(dropped))}


def dropped_groups_budget(cfg: DynamicSamplingConfig, num_prompts_per_step: int) -> int:
    """Most zero-variance groups one RL step may drop before it fails (null = 10 x groups per step)."""
    if cfg.max_num_dropped_groups_per_step is not None:
        return cfg.max_num_dropped_groups_per_step
    return 10 * num_prompts_per_step
