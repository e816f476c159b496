"""The adaptive staleness rule: how the `in_order` sampler's bound moves with the measured mismatch.

Owns: the bound's state (the current bound, the count of consecutive low-mismatch steps)
and the rule that updates it from one RL step's metrics (`async_rl.sampler.adaptive`):

- the signal is the step's `train/<metric>` (default `gen_train_kl`, the k3 estimate of
  KL(pi_gen || pi_prev) per generated token, which grows with both the engine mismatch and
  the staleness of the step's groups);
- signal > high_threshold: narrow by one (down to min) at once, and reset the count;
- signal < low_threshold: count the step; after `patience_steps` such steps in a row widen
  by one (up to max) and reset the count;
- otherwise (the hysteresis band low <= signal <= high): hold and reset the count;
- a step whose groups were admitted under a bound other than the current one (b, the
  step's `async/trained_staleness_bound`) says nothing about the current bound, only about
  b: a high signal with b > current (an earlier narrowing has not reached training yet) does
  not narrow again, and a low signal with b < current (a widening has not reached training
  yet) is not counted (the count holds). Without this the bound overshoots: the groups
  already dispatched under the old, wider bound keep the signal high for up to that many
  steps, and each of them narrowed once more (measured: 2 -> 1 -> 0 in a row, a fifth of the
  steps spent synchronous).

Narrowing is immediate and widening slow on purpose (asymmetric, as a congestion window):
a rising mismatch is a risk to the update, a low one only a missed speed-up, and the effect
of a widening on the signal shows only once the groups dispatched under it train. The idea
of bounding staleness and letting importance-weight statistics drive how much off-policy data
is admitted comes from AReaL (Fu et al. 2025, arXiv:2505.24298, staleness-aware PPO with a
maximum staleness eta) and M2PO (Zheng et al. 2025, "Prosperity before collapse: how far can off-policy RL
reach with stale data on LLMs?", which watches the second moment of the importance
weights under stale data); this rule is rl_core's own.

Does not own: where the bound is applied (`InOrderSampler.can_admit`), the metric (the
trainer's off-policy correction computes it: rl_core.algorithms.offpolicy).
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
