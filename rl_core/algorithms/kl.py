"""KL divergence to a reference policy, estimated per token from sampled tokens.

Owns: the k1/k2/k3 estimators (Schulman 2020, "Approximating KL divergence": with
x = log pi_ref(y) - log pi(y), k1 = -x, k2 = x^2 / 2, k3 = expm1(x) - x) with their input
(log-ratio) and output clamps, used as a loss term (`losses.py`) or as a reward penalty
(`kl_reward_penalty`, consumed by the advantage estimators). k3 is never exp(x) - 1 - x
(float32 cancellation), and below `K3_SERIES_BELOW` it is its Taylor series x^2/2 + ...
+ x^8/40320, so it stays >= 0 and accurate at tiny x.

Does not own: computing the logprobs (trainer) or the choice between the two uses (config
validation forbids both at once).

Read more: docs/algorithms.md, "KL to the reference policy" (the float32 errors, the clamps).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
DEFAULT_INPUT_CLAMP = 20.0
K3_SERIES_BELOW = 0.1  # |log r| below this: the Taylor series (expm1(x) - x cancels there)


def k3_from_log_ratio(log_r: torch.Tensor) -> torch.Tensor:
    """exp(x) - 1 - x, precise in the tensor's own dtype for every x (relative error ~1e-6 in float32)."""
    small = log_r.abs() < K3_SERIES_BELOW
    x = log_r.clamp(-K3_SERIES_BELOW, K3_SERIES_BELOW)  # the series branch never sees large x (no inf gradients)
    # Horner form of x^2 (1/2 + x/6 + x^2/24 + ... + x^6/40320): the terms of exp beyond 1 + x
    series = x * x * (0.5 + x * (1 / 6 + x * (1 / 24 + x * (1 / 120 + x * (1 / 720 + x * (1 / 5040 + x / 40320))))))
    return torch.where(small, series, torch.expm1(log_r) - log_r)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str,
               input_clamp: float | None = DEFAULT_INPUT_CLAMP, output_clamp: float | None = None) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate [same shape], differentiable in `logprobs`."""
    log_r = ref_logprobs - logprobs
    if input_clamp is not None:
        log_r = log_r.clamp(-input_clamp, input_clamp)
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r.pow(2)
    elif estimator == "k3":
        kl = k3_from_log_ratio(log_r)
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def kl_reward_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, coef: float,
                      estimator: str = "k1", input_clamp: float | None = DEFAULT_INPUT_CLAMP,
                      output_clamp: float | None = None) -> torch.Tensor:
    """Per-token reward penalty `coef * KL_t` [B, T] (0 where mask is 0), detached.

    KL in the reward (Ouyang et al. 2022, "Training language models to follow instructions
    with human feedback", eq. 2; Hu 2025, REINFORCE++): the reward of token t becomes
    r_t - coef * KL_t. `logprobs` are those of the policy that produced the samples (the
    generation logprobs, or the trainer's at the start of the step).
    Sum it over a sequence's tokens for a sequence-level penalty.
    """
    with torch.no_grad():
        kl = kl_penalty(logprobs.detach(), ref_logprobs.detach(), estimator, input_clamp, output_clamp)
        return coef * kl * mask
