"""Generalised advantage estimation (GAE) for PPO with a critic: per-token advantages and returns.

Owns: placing a sample's reward on its tokens, the backward GAE recursion over masked token
sequences (Schulman et al. 2016, eqs. 11-16: delta_t = r_t + gamma V_next - V_t, A_t =
delta_t + gamma lam A_next over the valid tokens, V_next = A_next = 0 after the last), the
bootstrap of a truncated completion from V(s_L) (Pardo et al. 2018, sec. 3), separate lambdas
for the advantages and the critic's targets R_t = A_t(value_lam) + V_t, and VAPO's
length-adaptive lambda 1 - 1 / (alpha l_i) (Yue et al. 2025, arXiv:2504.05118, eq. 8).
Alignment as in `types.py`: position t describes token t; `values[:, t]` is V(s_t).

Does not own: the critic (`rl_core.train.critic`), the KL reward penalty (`kl.py`) or the
per-chunk dispatch (`estimate.py`).

Read more: docs/algorithms.md, "Advantage estimators" (gae) and "PPO: the critic".
"""

from __future__ import annotations

import torch


def token_rewards(seq_rewards: torch.Tensor, mask: torch.Tensor, token_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T]: each sample's scalar reward on its last valid token, minus `token_penalty` on every valid token."""
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64, device=mask.device)
    pos = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(mask > 0, pos, torch.full_like(pos, -1)).max(dim=1).values
    has = last >= 0
    out[has, last[has]] = seq_rewards.to(device=mask.device, dtype=torch.float64)[has]
    if token_penalty is not None:
        out = out - token_penalty.to(torch.float64) * mask
    return out


def length_adaptive_lambda(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """[B] VAPO lambda = 1 - 1 / (alpha * length), clamped to [0, 1] (0 for an empty sequence)."""
    lengths = lengths.to(torch.float64)
    lam = 1.0 - 1.0 / (alpha * lengths.clamp(min=1e-12))
    return torch.where(lengths > 0, lam.clamp(0.0, 1.0), torch.zeros_like(lam))


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                   lam: float | torch.Tensor, bootstrap: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] GAE advantages (0 at masked positions). `lam` is a float or a [B] tensor of per-sequence
    lambdas; `bootstrap` [B] the value after each sequence's last valid token (None = 0 for all)."""
    B, T = rewards.shape
    r = rewards.to(torch.float64)
    v, m = values.to(r.device, torch.float64), mask.to(r.device, torch.float64)
    lam_t = torch.as_tensor(lam, dtype=torch.float64, device=r.device)
    lam_t = lam_t.expand(B) if lam_t.dim() == 0 else lam_t
    adv = torch.zeros(B, T, dtype=torch.float64, device=r.device)
    next_value = torch.zeros(B, dtype=torch.float64, device=r.device)
    if bootstrap is not None:
        next_value = bootstrap.to(r.device, torch.float64).reshape(B).clone()
    next_adv = torch.zeros(B, dtype=torch.float64, device=r.device)
    for t in range(T - 1, -1, -1):
        valid = m[:, t] > 0
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam_t * next_adv
        adv[:, t] = torch.where(valid, a, torch.zeros_like(a))
        next_value = torch.where(valid, v[:, t], next_value)
        next_adv = torch.where(valid, a, next_adv)
    return adv


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                lam: float = 0.95, value_lam: float | None = None,
                length_adaptive_alpha: float | None = None,
                bootstrap: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [B, T], returns [B, T]) in float64, both 0 at masked positions.

    advantages use `lam` (or the length-adaptive lambda when `length_adaptive_alpha` is set);
    returns = GAE(value_lam) + V, with value_lam defaulting to `lam`. `bootstrap` [B]: the
    value after each sequence's last valid token (0 = the episode ended; None = 0 for all).
    """
    policy_lam: float | torch.Tensor = lam
    if length_adaptive_alpha is not None:
        policy_lam = length_adaptive_lambda(mask.sum(dim=1), length_adaptive_alpha)
    adv = gae_advantages(rewards, values, mask, gamma, policy_lam, bootstrap)
    v_lam = lam if value_lam is None else value_lam
    same = length_adaptive_alpha is None and v_lam == lam
    value_adv = adv if same else gae_advantages(rewards, values, mask, gamma, v_lam, bootstrap)
    returns = (value_adv + values.to(device=adv.device, dtype=torch.float64)) * mask.to(adv.device, torch.float64)
    return adv, returns
