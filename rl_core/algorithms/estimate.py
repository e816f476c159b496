"""Advantages for one training chunk: every estimator, KL in the reward, and GAE on critic values.

Owns: `estimate_advantages`, the one call the train pump makes per packed chunk, and the
order of operations: KL in the reward (`kl.kl_reward_penalty`), then `gae` on token rewards
and critic values, or `reinforce_pp` with token-level KL as a return to go (Hu 2025, eq. 5),
or one advantage per sample broadcast over its completion tokens. Statistics and whitening
run over the chunk (the valid samples only with `advantage.exclude_invalid_from_stats`).

Does not own: computing reference logprobs or critic values (trainer / critic), or writing
the result into the chunk (the caller sets `chunk.advantages`, `chunk.values`, `chunk.returns`).

Read more: docs/algorithms.md, "Advantage estimators" and "KL to the reference policy".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from rl_core.algorithms.advantages import (group_ids_from_sizes, sequence_advantages, stack_components,
                                           whiten, group_stats)
from rl_core.algorithms.gae import compute_gae, token_rewards
from rl_core.algorithms.kl import kl_reward_penalty
from rl_core.algorithms.metrics import Pair, masked_sum_pair, pairs_to_floats
from rl_core.config.schema import AdvantageConfig
from rl_core.packing import ARENA
from rl_core.types import TrainChunk


@dataclass
class AdvantageEstimate:
    advantages: torch.Tensor  # [B, T] float32, 0 outside loss_mask
    sample_advantages: torch.Tensor | None = None  # [B] float32 when the estimator gives one value per sample
    returns: torch.Tensor | None = None  # [B, T] float32, gae only: the critic's targets
    metrics: dict[str, Pair] = field(default_factory=dict)


def estimate_advantages(cfg: AdvantageConfig, chunk: TrainChunk, rewards: Sequence[float] | torch.Tensor,
                        group_sizes: Sequence[int], *,
                        components: Sequence[Mapping[str, float]] | Mapping[str, torch.Tensor] | None = None,
                        ref_logprobs: torch.Tensor | None = None,
                        values: torch.Tensor | None = None,
                        valid: Sequence[bool] | torch.Tensor | None = None,
                        truncated: Sequence[bool] | torch.Tensor | None = None,
                        final_values: torch.Tensor | None = None,
                        binary_loss_mask: bool = False) -> AdvantageEstimate:
    """Advantages for the B samples of `chunk`, which hold consecutive groups of `group_sizes`.

    rewards: [B] (shaped) scalar rewards. components: the samples' named rewards (gdpo).
    ref_logprobs: [B, T] reference-policy logprobs (needed when kl_in_reward_coef > 0).
    values: [B, T] the critic's values of the chunk (`Critic.values(chunk)`, needed by gae).
    valid: [B] samples that enter the statistics when `exclude_invalid_from_stats` (default:
    `chunk.sample_mask > 0`). truncated, final_values: [B] finish reason `length`, and the
    critic's value after each sample's last token (`bootstrap_truncated`, gae).
    binary_loss_mask: the caller knows every `chunk.loss_mask` entry is 0 or 1 (packing without
    completion masks): sequence advantages are then broadcast in float32 (the same bits).
    """
    mask32 = chunk.loss_mask
    # the float64 [B, T] mask only where the token-level paths need it (the sequence-level path
    # broadcasts [B] advantages without materialising it: `broadcast_sequence_advantages`)
    token_level = cfg.kl_in_reward_coef > 0 or cfg.estimator == "gae"
    mask = mask32.to(torch.float64) if token_level else mask32
    B = mask.shape[0]
    if sum(group_sizes) != B:
        raise ValueError(f"group_sizes add up to {sum(group_sizes)} samples but the chunk holds {B}")
    # a list of floats through NumPy (the same float64 values; torch.as_tensor converts a long list slower)
    r = (torch.from_numpy(np.array(rewards, dtype=np.float64)) if type(rewards) is list
         else torch.as_tensor(rewards, dtype=torch.float64)).reshape(B).to(mask.device)
    gid = group_ids_from_sizes(group_sizes).to(mask.device)
    ok = None  # [B] bool: the samples that enter the statistics (None = all)
    if cfg.exclude_invalid_from_stats:
        ok = (chunk.sample_mask > 0) if valid is None else torch.as_tensor(valid, dtype=torch.bool)
        ok = ok.reshape(B).to(mask.device)
    metrics: dict = {}
    token_pen = None
    if cfg.kl_in_reward_coef > 0:
        if ref_logprobs is None:
            raise ValueError("advantage.kl_in_reward_coef > 0 needs the reference policy's logprobs of the chunk "
                             "(trainer.logprobs(chunk, reference=True))")
        pen = kl_reward_penalty(chunk.gen_logprobs, ref_logprobs, mask, cfg.kl_in_reward_coef,
                                cfg.kl_in_reward_estimator).to(torch.float64)
        metrics["kl_in_reward"] = masked_sum_pair(pen / cfg.kl_in_reward_coef, mask)
        if cfg.kl_in_reward_level == "sequence":
            r = r - pen.sum(dim=1)
        else:
            token_pen = pen
    if cfg.estimator == "gae":
        if values is None:
            raise ValueError("advantage.estimator 'gae' needs the critic's values of the chunk (critic.values(chunk))")
        tok_r = token_rewards(r, mask, token_pen)
        adv, ret = compute_gae(tok_r, values, mask, cfg.gamma, cfg.lam, cfg.value_lam, cfg.length_adaptive_alpha,
                               _bootstrap(cfg, B, truncated, final_values, mask.device))
        if ok is not None:
            adv = adv * ok[:, None]
        if cfg.whiten:
            adv = whiten(adv, mask if ok is None else mask * ok[:, None], cfg.std_eps)
        metrics["value_mean"] = masked_sum_pair(values.to(torch.float64), mask)
        metrics["return_mean"] = masked_sum_pair(ret, mask)
        return AdvantageEstimate(adv.to(torch.float32), None, ret.to(torch.float32), pairs_to_floats(metrics))
    if token_pen is not None:
        if cfg.estimator != "reinforce_pp":
            raise ValueError(f"token-level KL in the reward needs estimator reinforce_pp or gae, not {cfg.estimator!r}")
        seq = r - group_stats(r, gid, ok)[2] if cfg.subtract_group_mean else r
        kl_to_go = torch.flip(torch.cumsum(torch.flip(token_pen * mask, [1]), dim=1), [1])
        valid_mask = mask if ok is None else mask * ok[:, None]
        adv = (seq[:, None] - kl_to_go) * valid_mask
        if cfg.whiten:
            adv = whiten(adv, valid_mask, cfg.std_eps)
        return AdvantageEstimate(adv.to(torch.float32), None, None, pairs_to_floats(metrics))
    comps = None
    if components is not None:
        comps = dict(components) if isinstance(components, Mapping) else stack_components(components)
    seq_adv = sequence_advantages(cfg, r, gid, comps, ok)
    return AdvantageEstimate(broadcast_sequence_advantages(seq_adv, mask32, binary_loss_mask),
                             seq_adv.to(torch.float32), None,
                             pairs_to_floats(metrics))


def broadcast_sequence_advantages(seq_adv: torch.Tensor, mask: torch.Tensor, binary: bool = False) -> torch.Tensor:
    """(seq_adv[:, None] * mask in float64).to(float32), [B, T]: on the CPU in one NumPy pass
    (float64 products rounded into the float32 output, no [B, T] float64 temporaries; the same
    bits), elsewhere with torch. `binary`: every mask entry is 0 or 1; the product is then
    taken in float32 from the rounded advantages: a * 1 rounds to float32(a) either way, and
    a * 0 is a zero with a's sign either way (rounding keeps the sign), so the bits are the
    same without a float64-to-float32 cast per element (advantages that are not finite in
    float32 take the float64 pass)."""
    if seq_adv.device.type == "cpu" and mask.device.type == "cpu" and mask.dtype == torch.float32:
        out = ARENA.empty(tuple(mask.shape), np.float32)  # reused memory (see packing.Arena)
        a32 = seq_adv.to(torch.float32) if binary else None
        if a32 is not None and bool(torch.isfinite(a32).all()):  # else (overflow, inf, NaN) in float64
            np.multiply(a32.numpy()[:, None], mask.numpy(), out=out)
        else:
            np.multiply(seq_adv.to(torch.float64).numpy()[:, None], mask.numpy(), out=out, casting="same_kind")
        return torch.from_numpy(out)
    return (seq_adv[:, None] * mask.to(torch.float64)).to(torch.float32)


def _bootstrap(cfg: AdvantageConfig, B: int, truncated, final_values, device) -> torch.Tensor | None:
    """[B] value after each sample's last token: the critic's where the completion was truncated, else 0."""
    if not cfg.bootstrap_truncated:
        return None
    if truncated is None or final_values is None:
        raise ValueError("advantage.bootstrap_truncated needs which samples were truncated and the critic's value "
                         "after each sample's last token (critic.values(chunk, with_final=True))")
    cut = torch.as_tensor(truncated, dtype=torch.bool).reshape(B).to(device)
    v = final_values.to(device, torch.float64).reshape(B)
    return torch.where(cut, v, torch.zeros_like(v))
