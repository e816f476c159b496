"""Sequence-level advantage estimators: pure functions from rewards to one advantage per sample.

Owns: the formulas (each tested against hand-computed values) and `compute_advantages`,
the dispatch on `advantage.estimator` for lists of groups. Does not own: where rewards
come from (environments), reward shaping (`shaping.py`), token-level estimators (GAE:
`gae.py`; the per-chunk dispatch with KL in the reward and critic values: `estimate.py`),
which groups are trained (samplers) or packing advantages into tensors (`types`).

Groups: a batch is a flat vector of B rewards plus `group_ids` [B] saying which prompt
group each sample belongs to (ragged groups allowed). Every sample counts in its group's
statistics, including samples later excluded from the loss (overlong filtering).

- GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, sec. 4.1.2): A_i = (r_i - b) / (std + eps)
  with b the group mean, or the leave-one-out mean b_i = mean_{j != i} r_j (Kool et al. 2019,
  "Buy 4 REINFORCE samples, get a baseline for free"); std is the Bessel-corrected standard
  deviation of the group. A group whose rewards are all equal gets exactly 0, and so does a
  group of one sample (nothing to compare it with) in the ragged path.
- GDPO (Liu et al. 2026, "GDPO: group reward-decoupled normalization policy optimization
  for multi-reward RL optimization", arXiv:2601.05242): each named reward component k is
  normalised per group like GRPO, A = sum_k w_k A_k, then A is whitened over the batch
  (so its scale does not grow with the number of components).
- REINFORCE++ (Hu 2025, "REINFORCE++: a simple and efficient approach for aligning large
  language models", arXiv:2501.03262): A_i = r_i - mean(group of i) (the "baseline" variant;
  optional), then whitened over the batch.
- raw reward: A_i = r_i, optionally whitened over the batch.
Whitening: (x - mean) / (std + eps) over the valid elements (Bessel-corrected std); when the
spread is zero (or one element) the values are only mean-centred.
"""

from __future__ import annotations

from typing import Mapping, Sequence

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
        # b_i = (sum_j r_j - r_i) / (N - 1)
        adv = r - (r.sum(dim=1, keepdim=True) - r) / (n - 1)
    else:
        raise ValueError(f"unknown baseline {baseline!r}; expected 'mean' or 'leave_one_out'")
    if normalize_std:
        std = r.std(dim=1, keepdim=True, unbiased=True)
        adv = adv / (std + eps)
    # identical rewards: the numerator is exactly 0 already; keep it exact under float noise
    same = (r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values)
    adv = torch.where(same, torch.zeros_like(adv), adv)
    return adv.to(torch.float32)


def group_ids_from_sizes(sizes: Sequence[int]) -> torch.Tensor:
    """[sum(sizes)] long: 0 for the first group's samples, 1 for the second's, ..."""
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(list(sizes), dtype=torch.long))


def group_stats(r: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sample (group size, group sum, group mean, group unbiased std, group is constant)."""
    gid = gid.to(r.device)
    g = int(gid.max().item()) + 1 if gid.numel() else 0
    kw = {"dtype": r.dtype, "device": r.device}
    size = torch.zeros(g, **kw).index_add_(0, gid, torch.ones_like(r))
    total = torch.zeros(g, **kw).index_add_(0, gid, r)
    mean = total / size.clamp(min=1)
    sq = torch.zeros(g, **kw).index_add_(0, gid, (r - mean[gid]) ** 2)
    std = torch.sqrt(sq / (size - 1).clamp(min=1))
    hi = torch.full((g,), -torch.inf, **kw).scatter_reduce_(0, gid, r, "amax")
    lo = torch.full((g,), torch.inf, **kw).scatter_reduce_(0, gid, r, "amin")
    return size[gid], total[gid], mean[gid], std[gid], (hi == lo)[gid]


def group_normalized(rewards: torch.Tensor, group_ids: torch.Tensor, baseline: str = "mean",
                     normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO on ragged groups: rewards [B], group_ids [B] -> advantages [B] (float64)."""
    r = rewards.to(torch.float64)
    size, total, mean, std, same = group_stats(r, group_ids)
    if baseline == "mean":
        adv = r - mean
    elif baseline == "leave_one_out":
        adv = r - (total - r) / (size - 1).clamp(min=1)
    else:
        raise ValueError(f"unknown baseline {baseline!r}; expected 'mean' or 'leave_one_out'")
    if normalize_std:
        adv = adv / (std + eps)
    return torch.where(same | (size < 2), torch.zeros_like(adv), adv)


def whiten(x: torch.Tensor, mask: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """(x - mean) / (std + eps) over the elements where mask > 0 (all when None); 0 elsewhere.

    Zero spread, or a single element: only mean-centred."""
    m = torch.ones_like(x) if mask is None else mask.to(x.dtype)
    n = m.sum()
    if n == 0:
        return torch.zeros_like(x)
    mean = (x * m).sum() / n
    centred = (x - mean) * m
    if n < 2:
        return centred
    std = torch.sqrt((centred ** 2).sum() / (n - 1))
    if std == 0:
        return centred
    return centred / (std + eps)


def gdpo_advantages(components: Mapping[str, torch.Tensor], group_ids: torch.Tensor,
                    weights: Mapping[str, float] | None = None, baseline: str = "mean",
                    normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GDPO: components name -> rewards [B]; `weights` empty/None = every component, weight 1. -> [B] (float64)."""
    if weights:
        missing = sorted(set(weights) - set(components))
        if missing:
            raise KeyError(f"reward component(s) {missing} are weighted but the samples carry only {sorted(components)}")
        use = {k: float(w) for k, w in weights.items()}
    else:
        use = {k: 1.0 for k in components}
    if not use:
        raise ValueError("GDPO needs at least one named reward component per sample")
    total = None
    for name in sorted(use):
        a = use[name] * group_normalized(components[name], group_ids, baseline, normalize_std, eps)
        total = a if total is None else total + a
    return whiten(total, eps=eps)


def reinforce_pp_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, subtract_group_mean: bool = True,
                            whiten_batch: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++(-baseline) with one reward per sample: [B] -> [B] (float64)."""
    r = rewards.to(torch.float64)
    if subtract_group_mean:
        r = r - group_stats(r, group_ids)[2]
    return whiten(r, eps=eps) if whiten_batch else r


def raw_reward_advantages(rewards: torch.Tensor, whiten_batch: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """The reward itself, optionally whitened over the batch: [B] -> [B] (float64)."""
    r = rewards.to(torch.float64)
    return whiten(r, eps=eps) if whiten_batch else r


def sequence_advantages(cfg: AdvantageConfig, rewards: torch.Tensor, group_ids: torch.Tensor,
                        components: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """One advantage per sample [B] (float64) for every estimator except gae."""
    if cfg.estimator == "grpo":
        return group_normalized(rewards, group_ids, cfg.baseline, cfg.normalize_std, cfg.std_eps)
    if cfg.estimator == "gdpo":
        if not components:
            raise ValueError("advantage.estimator 'gdpo' needs the named reward components of every sample "
                             "(Sample.rewards); none were given")
        return gdpo_advantages(components, group_ids, cfg.reward_weights, cfg.baseline, cfg.normalize_std,
                               cfg.std_eps)
    if cfg.estimator == "reinforce_pp":
        return reinforce_pp_advantages(rewards, group_ids, cfg.subtract_group_mean, cfg.whiten, cfg.std_eps)
    if cfg.estimator == "raw_reward":
        return raw_reward_advantages(rewards, cfg.whiten, cfg.std_eps)
    if cfg.estimator == "gae":
        raise ValueError("advantage.estimator 'gae' gives one advantage per token from critic values: "
                         "use rl_core.algorithms.estimate.estimate_advantages")
    raise ValueError(f"unknown advantage estimator {cfg.estimator!r}")


def stack_components(per_sample: Sequence[Mapping[str, float]]) -> dict[str, torch.Tensor]:
    """[{name: value}] per sample -> {name: [B] tensor}; every sample must carry the same names."""
    if not per_sample:
        return {}
    names = sorted(per_sample[0])
    for i, comp in enumerate(per_sample):
        if sorted(comp) != names:
            raise ValueError(f"sample {i} carries reward components {sorted(comp)}, sample 0 carries {names}: "
                             "GDPO needs the same named rewards on every sample")
    return {k: torch.tensor([float(c[k]) for c in per_sample], dtype=torch.float64) for k in names}


def check_reward_weights(cfg: AdvantageConfig, reward_names: Sequence[str]) -> None:
    """Preflight (call once the environment is known, before anything expensive): every
    component named in `advantage.reward_weights` must be one the environment reports."""
    if cfg.estimator != "gdpo":
        return
    missing = sorted(set(cfg.reward_weights) - set(reward_names))
    if missing or not reward_names:
        from rl_core.errors import RecipeError

        raise RecipeError.single("advantage.reward_weights", dict(cfg.reward_weights),
                                 f"names among the environment's reward components {list(reward_names)}",
                                 f"remove or rename {missing}" if missing else
                                 "use an environment that reports named rewards, or another estimator.")


def compute_advantages(cfg: AdvantageConfig, group_rewards: list[list[float]],
                       group_components: list[list[Mapping[str, float]]] | None = None) -> list[list[float]]:
    """Dispatch on `advantage.estimator` for a list of groups; returns one list per group.

    `group_components` (the samples' named rewards, same nesting) is needed by gdpo only.
    Batch whitening (gdpo, reinforce_pp, raw_reward) is over the groups of this call.
    """
    if cfg.estimator == "grpo":
        sizes = {len(g) for g in group_rewards}
        if len(sizes) == 1:
            adv = grpo_advantages(torch.tensor(group_rewards, dtype=torch.float64), cfg.baseline,
                                  cfg.normalize_std, cfg.std_eps)
            return adv.tolist()
        # ragged groups (a sample was dropped): compute one by one
        return [grpo_advantages(torch.tensor(g, dtype=torch.float64), cfg.baseline, cfg.normalize_std,
                                cfg.std_eps)[0].tolist() for g in group_rewards]
    sizes = [len(g) for g in group_rewards]
    gid = group_ids_from_sizes(sizes)
    rewards = torch.tensor([r for g in group_rewards for r in g], dtype=torch.float64)
    comps = None
    if group_components is not None:
        comps = stack_components([c for g in group_components for c in g])
    flat = sequence_advantages(cfg, rewards, gid, comps).to(torch.float32).tolist()
    out, start = [], 0
    for n in sizes:
        out.append(flat[start:start + n])
        start += n
    return out
