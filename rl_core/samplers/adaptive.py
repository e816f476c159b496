"""The adaptive staleness rule: how the `in_order` sampler's bound moves with the measured mismatch.

Owns: the bound's state (the current bound, the count of consecutive low-mismatch steps)
and the rule that updates it from one RL step's `train/<metric>` (`async_rl.sampler.adaptive`):
narrow by one at once above `high_threshold`, widen by one after `patience_steps` steps in a
row below `low_threshold`, hold in between; a step trained under a bound other than the
current one is evidence about that bound only (so the bound does not overshoot). Sources:
AReaL (Fu et al. 2025, arXiv:2505.24298) and M2PO (Zheng et al. 2025, "Prosperity before
collapse"); the rule is rl_core's.

Does not own: where the bound is applied (`InOrderSampler.can_admit`), the metric (the
trainer's off-policy correction computes it: rl_core.algorithms.offpolicy).

Read more: docs/controller.md, "Adaptive staleness".
"""

from __future__ import annotations

import math


class AdaptiveBound:
    def __init__(self, cfg, start: int):
        self.min = cfg.min_lookahead_versions
        self.max = cfg.max_lookahead_versions
        self.metric = cfg.metric
        self.low = cfg.low_threshold
        self.high = cfg.high_threshold
        self.patience = cfg.patience_steps
        self.bound = start
        self.low_streak = 0
        self.changes = 0

    @property
    def key(self) -> str:
        return f"train/{self.metric}"

    def update(self, metrics: dict, trained_bound: int | None = None) -> int:
        """Apply the rule to one RL step's metrics (`trained_bound`: the bound its groups were
        admitted under; None = the current bound); returns the new bound."""
        if self.key not in metrics:
            raise RuntimeError(f"the adaptive staleness bound reads {self.key}, which this RL step did not report "
                               "(the trainer computes it from the generation logprobs). Fix: use a generation backend "
                               "that returns logprobs, or set async_rl.sampler.adaptive.enabled: false.")
        x = float(metrics[self.key])
        if not math.isfinite(x):
            raise RuntimeError(f"the adaptive staleness bound read {self.key} = {x}; it must be a finite number")
        old = self.bound
        b = self.bound if trained_bound is None else trained_bound
        if x > self.high:
            if b <= self.bound:
                self.bound = max(self.min, self.bound - 1)
            self.low_streak = 0
        elif x < self.low:
            if b < self.bound:
                return self.bound
            self.low_streak += 1
            if self.low_streak >= self.patience:
                self.bound = min(self.max, self.bound + 1)
                self.low_streak = 0
        else:
            self.low_streak = 0
        if self.bound != old:
            self.changes += 1
        return self.bound

    def state_dict(self) -> dict:
        return {"bound": self.bound, "low_streak": self.low_streak, "changes": self.changes}

    def load_state_dict(self, state: dict) -> None:
        bound = int(state["bound"])
        if not self.min <= bound <= self.max:
            raise ValueError(f"checkpointed adaptive staleness bound {bound} is outside the recipe's range "
                             f"[{self.min}, {self.max}] (async_rl.sampler.adaptive); resume with the recipe it was saved with")
        self.bound = bound
        self.low_streak = int(state["low_streak"])
        self.changes = int(state["changes"])
