"""Off-policy correction between the generation engine's and the trainer's logprobs.

Owns: importance weights w = pi_prev / pi_gen at token or sequence level (`level`), their
truncation (`none`, `tis`, `icepop`, `seq-mask-tis`), the masking of sequences whose
logprob error is too large (`max_seq_mult_prob_error`), and the mismatch metrics. Sources:
truncated IS (Ionides 2008); for LLM RL, Yao et al. 2025 ("Your efficient RL framework
secretly brings you off-policy RL training") and AReaL (Fu et al. 2025, arXiv:2505.24298,
decoupled PPO); IcePop (Ling Team 2025, arXiv:2510.18855).

Does not own: the loss the weights multiply (`losses.py`) or where `prev` comes from (the
trainer: the policy at the start of the RL step, or the current weights detached when a
step takes one optimizer step).

Read more: docs/algorithms.md, "Off-policy correction" (formulas, knobs, metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rl_core.algorithms.kl import kl_penalty
from rl_core.algorithms.metrics import masked_extreme_pair, masked_sum_pair, pairs_to_floats

LOG_RATIO_CLAMP = 20.0
LEVELS = ("token", "sequence")
TRUNCATIONS = ("none", "tis", "icepop", "seq-mask-tis")


def _exp(log_w: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def importance_weights(prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, level: str,
                       truncation: str, min_ratio: float, max_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached IS weights [B, T] and a [B, T] bool flag of tokens whose weight (at its level) is out of range.

    The flag is computed for every truncation (with `none` it only feeds the metrics).
    """
    if level not in LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; expected one of {LEVELS}")
    if truncation not in TRUNCATIONS:
        raise ValueError(f"unknown truncation {truncation!r}; expected one of {TRUNCATIONS}")
    with torch.no_grad():
        log_tok = (prev - gen) * mask
        if truncation == "seq-mask-tis":
            if level != "sequence":
                raise ValueError("truncation 'seq-mask-tis' decides per sequence: it needs level 'sequence'")
            n = mask.sum(dim=1, keepdim=True)
            geo = _exp(log_tok.sum(dim=1, keepdim=True) / n.clamp(min=1))
            out = ((geo < min_ratio) | (geo > max_ratio)) & (n > 0)
            out = out.expand_as(prev)
            w = torch.where(out, torch.zeros_like(prev), _exp(log_tok))
            return w, out
        log_w = log_tok.sum(dim=1, keepdim=True).expand_as(prev) if level == "sequence" else log_tok
        raw = _exp(log_w)
        out = (raw < min_ratio) | (raw > max_ratio)
        if truncation == "none":
            return raw, out
        if truncation == "tis":
            return raw.clamp(min_ratio, max_ratio), out
        return torch.where(out, torch.zeros_like(raw), raw), out  # icepop


def seq_mult_prob_error(prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] mean over a sequence's valid tokens of exp(|gen - prev|) (1.0 for a sequence without valid tokens)."""
    with torch.no_grad():
        n = mask.sum(dim=1)
        err = (torch.exp((gen - prev).abs().clamp(max=LOG_RATIO_CLAMP)) * mask).sum(dim=1)
        return torch.where(n > 0, err / n.clamp(min=1), torch.ones_like(err))


@dataclass
class OffPolicyCorrection:
    """What the loss applies: detached weights, the (possibly reduced) mask, and metrics."""

    weights: torch.Tensor  # [B, T]; all ones when importance sampling is off
    mask: torch.Tensor  # [B, T]; the input mask with sequences dropped by the logprob-error threshold
    metrics: dict = field(default_factory=dict)  # name -> (sum, count): floats, or 0-dim tensors (as_floats=False)


def correct_off_policy(prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, *, enabled: bool = True,
                       level: str = "token", truncation: str = "tis", min_ratio: float = 0.0,
                       max_ratio: float = 2.0, max_seq_mult_prob_error: float | None = None,
                       as_floats: bool = True) -> OffPolicyCorrection:
    """Weights, mask and metrics for one microbatch (arguments mirror `loss.importance_sampling`).

    `as_floats=False` leaves the metric pairs as tensors, so that a caller converts all of its
    metrics with one device sync (`metrics.pairs_to_floats`)."""
    with torch.no_grad():
        prev = prev.detach()
        metrics: dict = {}
        seq_valid = mask.sum(dim=1) > 0
        sv = seq_valid.to(prev.dtype)
        seq_err = seq_mult_prob_error(prev, gen, mask)
        metrics["seq_mult_prob_error"] = masked_sum_pair(seq_err, sv)
        metrics["seq_mult_prob_error_max"] = masked_extreme_pair(seq_err, sv, "max")
        keep_mask = mask
        if max_seq_mult_prob_error is not None:
            drop = ((seq_err > max_seq_mult_prob_error) & seq_valid).to(prev.dtype)
            metrics["seq_masked_by_prob_error_frac"] = masked_sum_pair(drop, sv)
            keep_mask = mask * (1.0 - drop)[:, None]
        metrics["gen_train_kl"] = masked_sum_pair(kl_penalty(gen, prev, "k3"), mask)
        metrics["gen_logprob_abs_error"] = masked_sum_pair((prev - gen).abs(), mask)
        metrics["is_mult_prob_error"] = masked_sum_pair(torch.exp((gen - prev).abs().clamp(max=LOG_RATIO_CLAMP)), mask)
        if not enabled:
            w = torch.ones_like(prev)
        else:
            w, out = importance_weights(prev, gen, mask, level, truncation, min_ratio, max_ratio)
            metrics["is_oob_frac"] = masked_sum_pair(out.to(prev.dtype), mask)
            metrics["is_weight"] = masked_sum_pair(w, keep_mask)
            metrics["is_weight_min"] = masked_extreme_pair(w, keep_mask, "min")
            metrics["is_weight_max"] = masked_extreme_pair(w, keep_mask, "max")
        return OffPolicyCorrection(w, keep_mask, pairs_to_floats(metrics) if as_floats else metrics)
