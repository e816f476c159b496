"""KL divergence to a reference policy, estimated per token from sampled tokens.

Owns: the k1/k2/k3 estimators with their input (log-ratio) and output clamps, used as a
loss term (`losses.py`) or as a reward penalty (`kl_reward_penalty`, consumed by the
advantage estimators). Does not own: computing the logprobs (trainer) or the choice
between the two uses (config validation forbids both at once).

With log r_t = log pi_ref(y_t) - log pi(y_t) for a token y_t sampled from pi
(Schulman 2020, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html):
- k1 = -log r                 (unbiased, high variance, can be negative);
- k2 = (log r)^2 / 2          (biased, low variance, >= 0);
- k3 = (r - 1) - log r        (unbiased, low variance, >= 0).
k3 is evaluated as expm1(x) - x (x = log r), never as exp(x) - 1 - x: in float32 the latter
loses everything below ~1e-7 (2% relative error at x = -1e-3, negative at |x| = 1e-4). For
|x| < K3_SERIES_BELOW even expm1(x) - x cancels (9% error at 1e-6), so there the Taylor
series x^2/2 + x^3/6 + ... + x^8/40320 is used (truncation < 1e-12 relative); both are >= 0.
The log-ratio is clamped to [-input_clamp, input_clamp] before exp (20 keeps exp finite
in float32) and the estimate to [-output_clamp, output_clamp] (a few outlier tokens must
not dominate a step).
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
