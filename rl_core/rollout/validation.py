"""Validation: accuracy, pass@k and lengths of a policy on held-out prompts.

Owns: generating n samples per held-out prompt with validation-only sampling parameters
(greedy by default) on one pinned weight version, and the metrics: accuracy (mean
correctness over all samples: the environment's `info["correct"]`, `group.is_correct`),
`pass@n` (share of prompts with at least one correct sample among its n), `pass_at_k` (the
unbiased estimator of pass@k for every k in 1..n, Chen et al. 2021, eq. 1: `pass_at_k["1"]`
equals accuracy and `pass_at_k[str(n)]` equals `pass@n`), the mean reward and the mean of
each named reward component (`reward_components`), mean completion length, truncation rate;
each group retried as training's are (`async_rl.failure`). Used during training (by the
controller) and on saved checkpoints (by the workflow's validate/evaluate stages).

Does not own: when validation runs, or pinning the version (the caller must not refit
while `run` is in progress; the returned record names the version it saw).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from typing import Any

from rl_core.config.schema import RolloutFailureConfig, ValidationConfig
from rl_core.resilience import Attempts, FailureKind, gather_or_cancel, group_failed, retrying
from rl_core.rollout.group import GroupOptions, generate_group, is_correct, sampling_params


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from n samples of which c are correct (1 <= k <= n).

    Chen et al. 2021, "Evaluating large language models trained on code", arXiv:2107.03374,
    eq. 1: pass@k = 1 - C(n - c, k) / C(n, k), the chance that k samples drawn without
    replacement from the n include a correct one. Evaluated as the product
    1 - prod_{i = n-c+1}^{n} (1 - k / i) (the paper's numerically stable form: no large
    binomials); 1 when fewer than k samples are wrong.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"the number of correct samples must lie in [0, n={n}], got {c}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def component_means(samples) -> dict[str, float]:
    """Mean of each named reward component over the samples that report it (environment order)."""
    sums: dict[str, list[float]] = {}
    for s in samples:
        for name, value in s.rewards.items():
            sums.setdefault(name, []).append(value)
    return {name: statistics.fmean(values) for name, values in sums.items()}


class Validator:
    """Held-out validation. Each prompt's group is retried under the recipe's resilience policy
    (`failure`: `async_rl.failure`, as training's groups: separate infra and data budgets, the
    infra backoff and time budget); a group that exhausts them is left out while
    `failure.max_dropped_groups` allows (`dropped_prompts` in the record), else the run stops
    (`resilience.GroupDropped`). `on_retry(kind, exc)` is told of every retry."""

    def __init__(self, cfg: ValidationConfig, env, tokenizer, examples: list[dict[str, Any]], seed: int,
                 stop_token_ids: tuple[int, ...] = (), max_concurrency: int = 256,
                 failure: RolloutFailureConfig | None = None, on_retry=None, sessions=None):
        self.cfg = cfg
        self.env = env
        self.tokenizer = tokenizer
        limit = cfg.max_val_samples or len(examples)
        self.examples = examples[:limit]
        self.seed = seed
        self.params = sampling_params(cfg.sampling, stop_token_ids, env.stop_strings())
        self.max_concurrency = max_concurrency
        self.failure = failure or RolloutFailureConfig()
        self.on_retry = on_retry
        self.opts = GroupOptions(sessions=sessions)  # agent environments: the run's episode session server

    async def run(self, backend, label: str = "val") -> dict[str, Any]:
        t0 = time.monotonic()
        version = backend.weight_version
        k = self.cfg.num_val_generations_per_prompt
        sem = asyncio.Semaphore(max(1, self.max_concurrency // k))
        fail = self.failure
        retries = Counter()
        dropped: list[int] = []

        def retried(kind: FailureKind, exc: BaseException) -> None:
            retries[kind] += 1
            if self.on_retry is not None:
                self.on_retry(kind, exc)

        async def one(i: int, ex: dict):
            attempts = Attempts.of(fail)

            async def attempt():
                n = attempts.infra + attempts.data
                async with sem:  # not held while a retry backs off
                    return await generate_group(backend, self.env, self.tokenizer, ex, self.env.prompt_ids(ex), k,
                                                self.params, f"{label}-v{version}-{i}" + (f"/a{n}" if n else ""),
                                                (self.seed, 10**9 + version, i), self.opts)
            try:
                return await retrying(attempt, attempts, fail.backoff_base_s, fail.max_backoff_s, retried)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - its attempts are exhausted: left out, or the run stops
                dropped.append(i)
                if len(dropped) > fail.max_dropped_groups or len(dropped) == len(self.examples):
                    raise group_failed(f"the group of held-out example {i} in validation {label!r} (weight version "
                                       f"{version})", ex, attempts, f"async_rl.failure.max_dropped_groups="
                                       f"{fail.max_dropped_groups} is spent") from exc
                return None

        results = await gather_or_cancel([asyncio.ensure_future(one(i, ex)) for i, ex in enumerate(self.examples)])
        if backend.weight_version != version:
            raise RuntimeError(f"weights changed during validation ({version} -> {backend.weight_version})")
        kept = [(ex, g) for ex, g in zip(self.examples, results) if g is not None]
        examples, groups = [ex for ex, _ in kept], [g for _, g in kept]
        samples = [s for g in groups for s in g]
        correct = [[is_correct(s) for s in g] for g in groups]
        return {
            "weight_version": version,
            "num_prompts": len(groups),
            "num_generations_per_prompt": k,
            "accuracy": statistics.fmean(c for row in correct for c in row),
            f"pass@{k}": statistics.fmean(1.0 if any(row) else 0.0 for row in correct),
            "pass_at_k": {str(j): statistics.fmean(pass_at_k(k, sum(row), j) for row in correct)
                          for j in range(1, k + 1)},
            "reward_mean": statistics.fmean(s.reward for s in samples),
            "reward_components": component_means(samples),
            "mean_length": statistics.fmean(len(s.completion_ids) for s in samples),
            "truncation_rate": statistics.fmean(1.0 if s.truncated else 0.0 for s in samples),
            "seconds": time.monotonic() - t0,
            "dropped_prompts": len(dropped),
            "infra_retries": retries[FailureKind.INFRA],
            "data_retries": retries[FailureKind.DATA],
            "examples": [
                {"prompt": ex.get("prompt"), "answer": ex.get("answer"), "completion": g[0].info.get("text"),
                 "correct": bool(c[0])}
                for ex, g, c in list(zip(examples, groups, correct))[:8]
            ],
        }
