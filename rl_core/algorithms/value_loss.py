"""The critic's loss: PPO value clipping, in the sum form of `protocols.LossOutput`.

Owns: the per-token value loss and its aggregation (sum over valid tokens, normaliser = their
count), so that critic steps stream in chunks exactly like policy steps: per valid token,
l_t = 1/2 max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -eps, eps) - R_t)^2) (value
clipping of OpenAI Baselines' PPO2, Dhariwal et al. 2017, analysed in Engstrom et al. 2020,
sec. 3); eps None gives 1/2 (V_t - R_t)^2. The mask is loss_mask * sample_mask: samples out
of the policy loss (overlong-filtered, environment-masked) leave the critic's loss too.

Does not own: the value model (`rl_core.train.critic`) or the targets (`gae.py` computes
the returns; `chunk.values` holds V_old).

Read more: docs/algorithms.md, "PPO: the critic and mini-steps".
"""

from __future__ import annotations

import torch

from rl_core.algorithms.metrics import masked_sum_pair, pairs_to_floats
from rl_core.protocols import LossOutput
from rl_core.types import TrainChunk


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor | None, returns: torch.Tensor,
                       mask: torch.Tensor, clip_eps: float | None) -> LossOutput:
    """Sum-form value loss over the masked tokens of [B, T] tensors."""
    err = (values - returns) ** 2
    metrics = {}
    if clip_eps is not None:
        if old_values is None:
            raise ValueError("value clipping needs the values at advantage time (chunk.values)")
        clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        err_clip = (clipped - returns) ** 2
        metrics["value_clip_frac"] = masked_sum_pair((err_clip > err).float(), mask)
        err = torch.maximum(err, err_clip)
    per_token = 0.5 * err
    metrics["value_loss"] = masked_sum_pair(per_token, mask)
    metrics["value_abs_error"] = masked_sum_pair((values - returns).abs(), mask)
    metrics["value_mean"] = masked_sum_pair(values, mask)
    n = mask.sum()
    metrics["_normalizer"] = (n, n)
    floats = pairs_to_floats(metrics)  # one device-to-host transfer
    return LossOutput(loss_sum=(per_token * mask).sum(), normalizer=floats.pop("_normalizer")[0], metrics=floats)


class ClippedValueLoss:
    """A value loss for `Critic.begin`: reads `chunk.returns` and `chunk.values` (V_old)."""

    def __init__(self, clip_eps: float | None = 0.2):
        self.clip_eps = clip_eps

    def __call__(self, values: torch.Tensor, chunk: TrainChunk) -> LossOutput:
        if chunk.returns is None:
            raise ValueError("the critic's loss needs chunk.returns (from estimate_advantages with estimator gae)")
        mask = chunk.loss_mask * chunk.sample_mask[:, None]
        return clipped_value_loss(values, chunk.values, chunk.returns, mask, self.clip_eps)
