"""Policy losses: clipped policy gradient with KL and importance-sampling correction.

Owns: per-token loss formulas and their aggregation into the *sum form* of
`protocols.LossOutput` (loss_sum + normalizer), so that a step streamed in chunks is
averaged exactly. Does not own: logprob computation (the trainer) or advantages.

Formulas (all masked by mask = loss_mask * sample_mask):
- ratio r_t = exp(logp_t - logp_prev_t); clipped surrogate (Schulman et al. 2017, PPO eq. 7)
  with separate low/high clip (Yu et al. 2025, DAPO "clip-higher"):
  pg_t = -min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t).
- With one optimizer step per RL step, logp_prev = logp.detach(): r = 1 in value and the
  gradient is the policy gradient; off-policy drift between the generation engine and the
  trainer is corrected by the importance weight w_t = exp(logp_prev_t - logp_gen_t)
  (detached), optionally truncated (TIS: clamp to [min, max]; Yao et al. 2025, "Your
  efficient RL framework secretly brings you off-policy RL training").
  Sequence level: w = exp(sum_t mask_t (logp_prev_t - logp_gen_t)) per sample.
- KL to the reference policy, with log r = logp_ref - logp (clamped to +-20) (Schulman 2020,
  "Approximating KL divergence"): k1 = -log r, k2 = (log r)^2 / 2, k3 = exp(log r) - 1 - log r.
- per-token loss l_t = w_t * pg_t + kl_coef * kl_t.
- aggregation `token`: sum_t mask_t l_t / sum_t mask_t over the whole step;
  `sequence`: mean over valid sequences of (sum_t mask_t l_t / sum_t mask_t).
"""

from __future__ import annotations

import torch

from rl_core.config.schema import LossConfig
from rl_core.protocols import LossOutput
from rl_core.types import TrainChunk

LOG_RATIO_CLAMP = 20.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    log_r = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.pow(2)
    if estimator == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}")


def importance_weights(prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, level: str,
                       truncation: str, min_ratio: float, max_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached IS weights [B, T] and a [B, T] flag of tokens whose weight was clamped."""
    log_w = (prev - gen) * mask
    if level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(prev)
    raw = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if truncation == "none":
        return raw, torch.zeros_like(raw, dtype=torch.bool)
    if truncation == "tis":
        clamped = raw.clamp(min_ratio, max_ratio)
        return clamped, (raw < min_ratio) | (raw > max_ratio)
    raise ValueError(f"unknown truncation {truncation!r}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, level: str) -> tuple[torch.Tensor, float]:
    """Sum form of the aggregation: (loss_sum, normalizer)."""
    if level == "token":
        return (per_token * mask).sum(), float(mask.sum().item())
    if level == "sequence":
        tokens = mask.sum(dim=1)
        valid = tokens > 0
        per_seq = (per_token * mask).sum(dim=1) / tokens.clamp(min=1)
        return per_seq[valid].sum(), float(valid.sum().item())
    raise ValueError(f"unknown aggregation {level!r}")


class ClippedPGLoss:
    """`loss.type: clipped_pg`."""

    def __init__(self, cfg: LossConfig):
        self.cfg = cfg
        self.needs_reference_logprobs = cfg.kl_coef > 0
        self.needs_prev_logprobs = False  # one optimizer step per RL step: prev = current (detached)

    def __call__(self, logprobs: torch.Tensor, chunk: TrainChunk) -> LossOutput:
        cfg = self.cfg
        mask = chunk.loss_mask * chunk.sample_mask[:, None]
        prev = chunk.prev_logprobs if chunk.prev_logprobs is not None else logprobs.detach()
        adv = chunk.advantages
        ratio = torch.exp((logprobs - prev).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        clipped = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
        pg = -torch.minimum(ratio * adv, clipped * adv)
        per_token = pg
        is_cfg = cfg.importance_sampling
        metrics: dict[str, tuple[float, float]] = {}
        n_tok = float(mask.sum().item())
        if is_cfg.enabled:
            w, was_clamped = importance_weights(prev, chunk.gen_logprobs, mask, is_cfg.level, is_cfg.truncation,
                                                is_cfg.min_ratio, is_cfg.max_ratio)
            per_token = w.detach() * pg
            metrics["is_weight"] = (float((w * mask).sum().item()), n_tok)
            metrics["is_clamped_frac"] = (float((was_clamped.float() * mask).sum().item()), n_tok)
        if cfg.kl_coef > 0:
            if chunk.ref_logprobs is None:
                raise ValueError("loss.kl_coef > 0 needs reference logprobs in the chunk")
            kl = kl_penalty(logprobs, chunk.ref_logprobs, cfg.kl_estimator)
            per_token = per_token + cfg.kl_coef * kl
            metrics["kl_ref"] = (float((kl.detach() * mask).sum().item()), n_tok)
        loss_sum, normalizer = aggregate(per_token, mask, cfg.aggregation)
        with torch.no_grad():
            metrics["pg_loss"] = (float((pg * mask).sum().item()), n_tok)
            metrics["ratio"] = (float((ratio * mask).sum().item()), n_tok)
            clip_hit = ((ratio * adv) > (clipped * adv)).float()
            metrics["clip_frac"] = (float((clip_hit * mask).sum().item()), n_tok)
            diff = (logprobs.detach() - chunk.gen_logprobs)
            metrics["gen_logprob_abs_error"] = (float((diff.abs() * mask).sum().item()), n_tok)
            # KL(gen || train) estimated with k3 on the generation samples
            metrics["gen_train_kl"] = (float((kl_penalty(chunk.gen_logprobs, logprobs.detach(), "k3") * mask).sum().item()), n_tok)
        return LossOutput(loss_sum=loss_sum, normalizer=normalizer, metrics=metrics)


def make_loss(cfg: LossConfig) -> ClippedPGLoss:
    if cfg.type == "clipped_pg":
        return ClippedPGLoss(cfg)
    raise ValueError(f"unknown loss type {cfg.type!r}")
