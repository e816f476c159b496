"""Policy losses: clipped policy gradient (PPO / dual clip / GSPO) and plain REINFORCE.

Owns: per-token policy-loss formulas (masked by loss_mask * sample_mask, then by the
off-policy mask) and their aggregation into the *sum form* of `protocols.LossOutput`
(loss_sum + normalizer), so that a step streamed in chunks is averaged exactly: the trainer
sums both over the step and divides once at `finish()`. Sources: PPO clip (Schulman et al.
2017, eq. 7); clip-higher (DAPO, Yu et al. 2025, arXiv:2503.14476); dual clip (Ye et al. 2020,
eq. 5); sequence-level ratio (GSPO, Zheng et al. 2025, arXiv:2507.18071, eq. 7); REINFORCE
(Williams 1992); `empty_sequences: zero` as verl's `seq-mean-token-mean`.

Does not own: logprob computation (trainer), advantages (`advantages.py`, `gae.py`),
importance weights (`offpolicy.py`), KL estimators (`kl.py`) or metric pairs (`metrics.py`).

Read more: docs/algorithms.md, "Policy losses" (formulas, knobs, refused combinations).
"""

from __future__ import annotations

import torch

from rl_core.algorithms.kl import kl_penalty  # noqa: F401  (re-exported: historical import path)
from rl_core.algorithms.metrics import masked_sum_pair, pairs_to_floats
from rl_core.algorithms.offpolicy import LOG_RATIO_CLAMP, correct_off_policy, importance_weights  # noqa: F401
from rl_core.config.schema import LossConfig
from rl_core.protocols import LossOutput
from rl_core.types import TrainChunk


def aggregate_tensors(per_token: torch.Tensor, mask: torch.Tensor, level: str,
                      empty_sequences: str = "drop") -> tuple[torch.Tensor, torch.Tensor]:
    """Sum form of the aggregation as tensors: (loss_sum, normalizer), without a device sync.

    `empty_sequences` (sequence level): `drop` a sequence without a trained token from the
    normaliser, or count it as a `zero` loss (the normaliser is then the number of rows)."""
    if level == "token":
        return (per_token * mask).sum(), mask.sum()
    if level == "sequence":
        tokens = mask.sum(dim=1)
        per_seq = (per_token * mask).sum(dim=1) / tokens.clamp(min=1)
        if empty_sequences == "zero":  # an empty row adds 0 to the sum and 1 to the normaliser
            return per_seq.sum(), torch.tensor(float(per_seq.shape[0]), dtype=per_token.dtype, device=per_token.device)
        if empty_sequences != "drop":
            raise ValueError(f"unknown empty_sequences {empty_sequences!r}; expected 'drop' or 'zero'")
        valid = (tokens > 0).to(per_token.dtype)
        return (per_seq * valid).sum(), valid.sum()
    raise ValueError(f"unknown aggregation {level!r}; expected 'token' or 'sequence'")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, level: str,
              empty_sequences: str = "drop") -> tuple[torch.Tensor, float]:
    """Sum form of the aggregation: (loss_sum, normalizer)."""
    loss_sum, normalizer = aggregate_tensors(per_token, mask, level, empty_sequences)
    return loss_sum, float(normalizer.item())


def sequence_log_ratio(logprobs: torch.Tensor, prev: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: mean over each sequence's valid tokens of (logp - prev), broadcast over its tokens (GSPO)."""
    n = mask.sum(dim=1, keepdim=True).clamp(min=1)
    return (((logprobs - prev) * mask).sum(dim=1, keepdim=True) / n).expand_as(logprobs)


def clipped_pg_terms(logprobs: torch.Tensor, prev: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                     eps_low: float, eps_high: float, dual_clip_c: float | None = None,
                     ratio_level: str = "token") -> tuple[torch.Tensor, dict]:
    """Per-token clipped surrogate loss [B, T] and its metrics (ratio, clip fractions) as tensor pairs.

    `dual_clip_c` must exceed 1 (a cap at or below 1 x |A| would cut into the ordinary clipped
    loss of negative advantages, not only bound the exploded ratios)."""
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (Ye et al. 2020: the cap -c*A for A < 0), got {dual_clip_c!r}; "
                         "use e.g. 3.0, or None to turn dual clipping off")
    if ratio_level == "token":
        log_ratio = logprobs - prev
    elif ratio_level == "sequence":
        log_ratio = sequence_log_ratio(logprobs, prev, mask)
    else:
        raise ValueError(f"unknown ratio level {ratio_level!r}; expected 'token' or 'sequence'")
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(-ratio * adv, -clipped * adv)
    metrics = {}
    with torch.no_grad():
        metrics["ratio"] = masked_sum_pair(ratio, mask)
        metrics["clip_frac"] = masked_sum_pair(((ratio * adv) > (clipped * adv)).float(), mask)
    if dual_clip_c is not None:
        cap = -dual_clip_c * adv
        capped = (adv < 0) & (pg > cap)
        pg = torch.where(capped, cap, pg)
        metrics["dual_clip_frac"] = masked_sum_pair(capped.float(), mask)
    return pg, metrics


class PolicyGradientLoss:
    """`loss.type: clipped_pg` and `loss.type: reinforce` (one class: they share IS, KL and aggregation).

    `multi_update=True` declares that an RL step takes several optimizer steps (PPO epochs or
    minibatches): the trainer must then fill `chunk.prev_logprobs` with the policy's logprobs
    at the start of the RL step (`needs_prev_logprobs`), or the ratio would always be 1.
    """

    def __init__(self, cfg: LossConfig, *, multi_update: bool = False):
        if cfg.type not in ("clipped_pg", "reinforce"):
            raise ValueError(f"unknown loss type {cfg.type!r}")
        self.cfg = cfg
        self.needs_reference_logprobs = cfg.kl_coef > 0
        self.needs_prev_logprobs = multi_update

    def __call__(self, logprobs: torch.Tensor, chunk: TrainChunk) -> LossOutput:
        cfg = self.cfg
        if chunk.prev_logprobs is None and self.needs_prev_logprobs:
            raise ValueError("this loss takes several optimizer steps per RL step and needs chunk.prev_logprobs "
                             "(the policy's logprobs at the start of the step); the trainer did not provide them")
        prev = chunk.prev_logprobs if chunk.prev_logprobs is not None else logprobs.detach()
        base_mask = chunk.loss_mask * chunk.sample_mask[:, None]
        isc = cfg.importance_sampling
        corr = correct_off_policy(prev, chunk.gen_logprobs, base_mask, enabled=isc.enabled, level=isc.level,
                                  truncation=isc.truncation, min_ratio=isc.min_ratio, max_ratio=isc.max_ratio,
                                  max_seq_mult_prob_error=isc.max_seq_mult_prob_error, as_floats=False)
        mask = corr.mask
        adv = chunk.advantages
        metrics = dict(corr.metrics)  # tensor pairs until the one conversion below
        if cfg.type == "reinforce":
            pg = -adv * logprobs
        else:
            pg, pg_metrics = clipped_pg_terms(logprobs, prev, adv, mask, cfg.clip_eps_low, cfg.clip_eps_high,
                                              cfg.dual_clip_c, cfg.ratio_level)
            metrics.update(pg_metrics)
        per_token = corr.weights * pg if isc.enabled else pg
        if cfg.kl_coef > 0:
            if chunk.ref_logprobs is None:
                raise ValueError("loss.kl_coef > 0 needs reference logprobs in the chunk (chunk.ref_logprobs)")
            kl = kl_penalty(logprobs, chunk.ref_logprobs, cfg.kl_estimator, cfg.kl_input_clamp, cfg.kl_output_clamp)
            per_token = per_token + cfg.kl_coef * kl
            metrics["kl_ref"] = masked_sum_pair(kl, mask)
        loss_sum, normalizer = aggregate_tensors(per_token, mask, cfg.aggregation, cfg.empty_sequences)
        metrics["pg_loss"] = masked_sum_pair(pg, mask)
        metrics["_normalizer"] = (normalizer, normalizer)
        floats = pairs_to_floats(metrics)  # one device-to-host transfer per microbatch
        return LossOutput(loss_sum=loss_sum, normalizer=floats.pop("_normalizer")[0], metrics=floats)


    def skipped_normalizer(self, chunk: TrainChunk) -> float:
        """What a microbatch without a trained token adds to the normaliser: its sequences under
        `aggregation: sequence, empty_sequences: zero`, else 0 (its loss sum is 0 either way)."""
        if self.cfg.aggregation == "sequence" and self.cfg.empty_sequences == "zero":
            return float(chunk.num_samples)
        return 0.0


def make_loss(cfg: LossConfig, *, multi_update: bool = False) -> PolicyGradientLoss:
    """The policy loss of `loss.type`; `multi_update` as in `PolicyGradientLoss`."""
    if cfg.type in ("clipped_pg", "reinforce"):
        return PolicyGradientLoss(cfg, multi_update=multi_update)
    raise ValueError(f"unknown loss type {cfg.type!r}")
