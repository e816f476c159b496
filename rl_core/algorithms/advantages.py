"""Sequence-level advantage estimators: pure functions from rewards to one advantage per sample.

Owns: the formulas (each tested against hand-computed values) and `compute_advantages`,
the dispatch on `advantage.estimator` for lists of groups: B rewards, `group_ids` [B]
(ragged groups allowed) and optionally `valid` [B] (`advantage.exclude_invalid_from_stats`).
Sources: GRPO (Shao et al. 2024, arXiv:2402.03300, sec. 4.1.2); leave-one-out baseline (Kool
et al. 2019; its std over the others as NeMo RL's `calculate_baseline_and_std_per_prompt`,
PR 1519); GDPO (Liu et al. 2026, arXiv:2601.05242); REINFORCE++ (Hu 2025, arXiv:2501.03262).

Does not own: where rewards come from (environments), reward shaping (`shaping.py`),
token-level estimators (`gae.py`, the per-chunk dispatch in `estimate.py`), which groups
are trained (samplers) or packing advantages into tensors.

Read more: docs/algorithms.md, "Advantage estimators" (formulas, knobs, edge cases).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from rl_core.config.schema import AdvantageConfig


def grpo_advantages(rewards: torch.Tensor, baseline: str = "mean", normalize_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, N] (G groups of N samples) -> advantages [G, N]; N = 1 gives 0."""
    if rewards.dim() == 1:
        rewards = rewards[None, :]
    r = rewards.to(torch.float64)
    n = r.shape[1]
    if n < 2:  # nothing to compare a lone sample with (as in the ragged path)
        return torch.zeros_like(r, dtype=torch.float32)
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


def _weights(r: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    return torch.ones_like(r) if valid is None else valid.to(device=r.device, dtype=r.dtype)


def _group_sums(r: torch.Tensor, gid: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sample statistics of its group over the samples with weight w > 0: size, total,
    mean, sq (sum of squared deviations from the mean), hi, lo (extreme values)."""
    gid = gid.to(r.device)
    g = int(gid.max().item()) + 1 if gid.numel() else 0
    kw = {"dtype": r.dtype, "device": r.device}
    size = torch.zeros(g, **kw).index_add_(0, gid, w)
    total = torch.zeros(g, **kw).index_add_(0, gid, r * w)
    mean = total / size.clamp(min=1)
    sq = torch.zeros(g, **kw).index_add_(0, gid, w * (r - mean[gid]) ** 2)
    use = w > 0
    hi = torch.full((g,), -torch.inf, **kw).scatter_reduce_(0, gid, torch.where(use, r, -torch.inf), "amax")
    lo = torch.full((g,), torch.inf, **kw).scatter_reduce_(0, gid, torch.where(use, r, torch.inf), "amin")
    return {"size": size[gid], "total": total[gid], "mean": mean[gid], "sq": sq[gid], "hi": hi[gid], "lo": lo[gid]}


def group_stats(r: torch.Tensor, gid: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Per-sample (group size, group sum, group mean, group unbiased std, group is constant),
    over the group's valid samples (every sample when `valid` is None)."""
    st = _group_sums(r, gid, _weights(r, valid))
    std = torch.sqrt(st["sq"] / (st["size"] - 1).clamp(min=1))
    return st["size"], st["total"], st["mean"], std, st["hi"] == st["lo"]


def _others_std(r: torch.Tensor, gid: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per valid sample i: (Bessel-corrected std of the other valid samples of its group, the
    others have no spread). Removing r_i from a group of n with mean m and squared deviations
    S leaves S - (r_i - m)^2 n / (n - 1) (Welford's downdate); "no spread" (all others equal,
    or fewer than two of them) is decided exactly on the values, never on a rounded std."""
    st = _group_sums(r, gid, w)
    size, hi, lo = st["size"], st["hi"], st["lo"]
    n_hi = _group_sums((r == hi).to(r.dtype), gid, w)["total"]  # valid samples at the group's max
    n_lo = _group_sums((r == lo).to(r.dtype), gid, w)["total"]
    two_values = (hi != lo) & (n_hi + n_lo == size)
    alone = ((r == hi) & (n_hi == 1)) | ((r == lo) & (n_lo == 1))
    others = size - 1
    flat = (hi == lo) | (two_values & alone) | (others < 2)
    ss_others = (st["sq"] - (r - st["mean"]) ** 2 * size / others.clamp(min=1)).clamp(min=0)
    return torch.sqrt(ss_others / (others - 1).clamp(min=1)), flat


def group_normalized(rewards: torch.Tensor, group_ids: torch.Tensor, baseline: str = "mean",
                     normalize_std: bool = True, eps: float = 1e-6, std_of: str = "group",
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO on ragged groups: rewards [B], group_ids [B] -> advantages [B] (float64).

    `std_of`: `group` (std of the whole group) or `others` (std of the other samples; needs
    baseline leave_one_out). `valid` [B]: only these samples enter the statistics; the
    others get 0."""
    r = rewards.to(torch.float64)
    size, total, mean, std, same = group_stats(r, group_ids, valid)
    w = _weights(r, valid)
    if baseline == "mean":
        adv = r - mean
    elif baseline == "leave_one_out":
        adv = r - (total - r * w) / (size - 1).clamp(min=1)
    else:
        raise ValueError(f"unknown baseline {baseline!r}; expected 'mean' or 'leave_one_out'")
    if normalize_std:
        if std_of == "group":
            adv = adv / (std + eps)
        elif std_of == "others":
            if baseline != "leave_one_out":
                raise ValueError("std_of 'others' goes with the leave-one-out baseline (baseline='leave_one_out')")
            std_o, flat = _others_std(r, group_ids, w)
            adv = torch.where(flat, adv, adv / (std_o + eps))
        else:
            raise ValueError(f"unknown std_of {std_of!r}; expected 'group' or 'others'")
    zero = same | (size < 2)
    if valid is not None:
        zero = zero | (w <= 0)
    return torch.where(zero, torch.zeros_like(adv), adv)


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
                    normalize_std: bool = True, eps: float = 1e-6, std_of: str = "group",
                    valid: torch.Tensor | None = None) -> torch.Tensor:
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
        a = use[name] * group_normalized(components[name], group_ids, baseline, normalize_std, eps, std_of, valid)
        total = a if total is None else total + a
    return whiten(total, valid, eps=eps)


def reinforce_pp_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, subtract_group_mean: bool = True,
                            whiten_batch: bool = True, eps: float = 1e-6,
                            valid: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++(-baseline) with one reward per sample: [B] -> [B] (float64); invalid samples get 0."""
    r = rewards.to(torch.float64)
    if subtract_group_mean:
        r = r - group_stats(r, group_ids, valid)[2]
    return _only_valid(whiten(r, valid, eps=eps) if whiten_batch else r, valid)


def raw_reward_advantages(rewards: torch.Tensor, whiten_batch: bool = False, eps: float = 1e-6,
                          valid: torch.Tensor | None = None) -> torch.Tensor:
    """The reward itself, optionally whitened over the batch: [B] -> [B] (float64); invalid samples get 0."""
    r = rewards.to(torch.float64)
    return _only_valid(whiten(r, valid, eps=eps) if whiten_batch else r, valid)


def _only_valid(adv: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    return adv if valid is None else torch.where(_weights(adv, valid) > 0, adv, torch.zeros_like(adv))


def sequence_advantages(cfg: AdvantageConfig, rewards: torch.Tensor, group_ids: torch.Tensor,
                        components: Mapping[str, torch.Tensor] | None = None,
                        valid: torch.Tensor | None = None) -> torch.Tensor:
    """One advantage per sample [B] (float64) for every estimator except gae.

    `valid` [B] (bool or 0/1): samples that enter the group and batch statistics; the others
    get 0. None = every sample (the default; `advantage.exclude_invalid_from_stats` decides
    whether the caller passes one)."""
    if cfg.estimator == "grpo":
        return group_normalized(rewards, group_ids, cfg.baseline, cfg.normalize_std, cfg.std_eps, cfg.std_of, valid)
    if cfg.estimator == "gdpo":
        if not components:
            raise ValueError("advantage.estimator 'gdpo' needs the named reward components of every sample "
                             "(Sample.rewards); none were given")
        return gdpo_advantages(components, group_ids, cfg.reward_weights, cfg.baseline, cfg.normalize_std,
                               cfg.std_eps, cfg.std_of, valid)
    if cfg.estimator == "reinforce_pp":
        return reinforce_pp_advantages(rewards, group_ids, cfg.subtract_group_mean, cfg.whiten, cfg.std_eps, valid)
    if cfg.estimator == "raw_reward":
        return raw_reward_advantages(rewards, cfg.whiten, cfg.std_eps, valid)
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
                       group_components: list[list[Mapping[str, float]]] | None = None,
                       group_valid: list[list[bool]] | None = None) -> list[list[float]]:
    """Dispatch on `advantage.estimator` for a list of groups; returns one list per group.

    The same formulas as the training path (`sequence_advantages`): a group of one sample
    gets 0. `group_components` (the samples' named rewards, same nesting) is needed by gdpo
    only; `group_valid` (same nesting) keeps invalid samples out of the statistics.
    Batch whitening (gdpo, reinforce_pp, raw_reward) is over the groups of this call.
    """
    sizes = [len(g) for g in group_rewards]
    gid = group_ids_from_sizes(sizes)
    rewards = torch.tensor([r for g in group_rewards for r in g], dtype=torch.float64)
    comps = None
    if group_components is not None:
        comps = stack_components([c for g in group_components for c in g])
    valid = None
    if group_valid is not None:
        valid = torch.tensor([bool(v) for g in group_valid for v in g])
    flat = sequence_advantages(cfg, rewards, gid, comps, valid).to(torch.float32).tolist()
    out, start = [], 0
    for n in sizes:
        out.append(flat[start:start + n])
        start += n
    return out
