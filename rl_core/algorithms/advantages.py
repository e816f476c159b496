"""Advantage estimators: pure functions from rewards to per-sample advantages.

Owns: the formulas, each tested against hand-computed values. Does not own: where rewards
come from (environments), which groups are trained (samplers), or packing advantages into
tensors (types.make_train_chunk).

GRPO (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2): for a group of N samples of one
prompt with rewards r_1..r_N, A_i = (r_i - b) / (std(r) + eps), with b the group mean.
The leave-one-out baseline b_i = mean_{j != i} r_j (Kool et al. 2019, "Buy 4 REINFORCE
samples, get a baseline for free") keeps the estimator unbiased. std is the unbiased
(Bessel-corrected) standard deviation of the group; a group whose rewards are all equal
gets advantages of exactly 0.
"""

from __future__ import annotations

import torch

from rl_core.config.schema import AdvantageConfig


def grpo_advantages(rewards: torch.Tensor, baseline: str = "mean", normalize_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, N] (G groups of N samples) -> advantages [G, N]."""
    if rewards.dim() == 1:
        rewards = rewards[None, :]
    r = rewards.to(torch.float64)
    n = r.shape[1]
    if n < 2:
        raise ValueError(f"GRPO needs at least 2 samples per group, got {n}")
    mean = r.mean(dim=1, keepdim=True)
    if baseline == "mean":
        adv = r - mean
    elif baseline == "leave_one_out":
        # b_i = (sum_j r_j - r_i) / (N - 1)  =>  r_i - b_i = N / (N - 1) * (r_i - mean)
        adv = (r - (r.sum(dim=1, keepdim=True) - r) / (n - 1))
    else:
        raise ValueError(f"unknown baseline {baseline!r}; expected 'mean' or 'leave_one_out'")
    if normalize_std:
        std = r.std(dim=1, keepdim=True, unbiased=True)
        adv = adv / (std + eps)
    # identical rewards: the numerator is exactly 0 already; keep it exact under float noise
    same = (r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values)
    adv = torch.where(same, torch.zeros_like(adv), adv)
    return adv.to(torch.float32)


def compute_advantages(cfg: AdvantageConfig, group_rewards: list[list[float]]) -> list[list[float]]:
    """Dispatch on `advantage.estimator` for a list of groups; returns one list per group."""
    if cfg.estimator == "grpo":
        sizes = {len(g) for g in group_rewards}
        if len(sizes) == 1:
            adv = grpo_advantages(torch.tensor(group_rewards, dtype=torch.float64), cfg.baseline,
                                  cfg.normalize_std, cfg.std_eps)
            return adv.tolist()
        # ragged groups (a sample was dropped): compute one by one
        return [grpo_advantages(torch.tensor(g, dtype=torch.float64), cfg.baseline, cfg.normalize_std,
                                cfg.std_eps)[0].tolist() for g in group_rewards]
    raise ValueError(f"unknown advantage estimator {cfg.estimator!r}")
