"""The pumps' ledger: the one record the rollout pump and the train pump share besides the
replay buffer and the version clock.

Owns: `PumpLedger`, whose fields each have one writer (the rollout pump's counters, failure
and in-flight count; the train pump's counters, its demand and its requests), and the
counters' checkpoint state. A pump that needs the other to act writes a request here and
waits on the shared condition: refills (dynamic sampling), aborting stale in-flight groups,
closing dispatch for a drain refit; the rollout pump, which alone holds the group tasks and
the prompt source, serves them. `step_metrics` reads this record, never a pump.

Does not own: the pumps' behaviour (rollout_pump.py, train_pump.py), the buffer's slots or
the weight version (the other two shared parts). The table of what each pump waits for and
what unblocks it: docs/architecture.md, "Data flow of one run".
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import asdict, dataclass, field


@dataclass
class RolloutStats:
    """The rollout pump's run counters (written by it alone)."""

    dispatched_groups: int = 0
    committed_groups: int = 0
    aborted_groups: int = 0  # aborted in flight (stale) or by the backend
    dropped_groups: int = 0  # exhausted their attempts
    replaced_groups: int = 0
    refill_groups: int = 0  # dispatched to refill steps dynamic sampling thinned
    infra_retries: int = 0
    data_retries: int = 0
    wasted_samples: int = 0  # generated but never trained: aborted or dropped (evicted: `TrainStats`)
    generated_tokens: int = 0
    idle_s: float = 0.0  # time spent waiting on a valve
    env_s: float = 0.0
    per_step_tokens: dict[int, int] = field(default_factory=dict)


@dataclass
class TrainStats:
    """The train pump's run counters (written by it alone)."""

    evicted_groups: int = 0
    dynamic_filtered_groups: int = 0  # zero-variance groups set aside (dynamic sampling)
    wasted_samples: int = 0  # samples of the evicted and set-aside groups
    train_retries: int = 0  # every retry: policy update, logprob/value passes, critic update
    pass_retries: int = 0  # of which logprob/value passes and critic updates


@dataclass
class PumpLedger:
    """What the two pumps share besides the buffer and the version clock (see the module doc)."""

    # written by the rollout pump
    rollout_stats: RolloutStats = field(default_factory=RolloutStats)
    dropped_per_step: Counter = field(default_factory=Counter)  # target step -> groups dropped for it
    inflight: int = 0  # groups dispatched and not finished
    failure: BaseException | None = None  # the first exception a group task raised (it stops the run)
    exhausted: bool = False  # dispatch has ended and every dispatched group has finished
    stale_aborted_groups: int = 0  # in-flight groups aborted because the sampler declared them stale
    stale_served: int = -1  # the trainer version of the last abort request served
    # written by the train pump
    train_stats: TrainStats = field(default_factory=TrainStats)
    demand: int | None = None  # groups the trainer may still consume (unstamped samplers' dispatch)
    stale_at: int = -1  # request: abort the in-flight groups stale at this trainer version
    draining: bool = False  # request: a drain refit holds dispatch closed
    # a request queue, appended by the train pump and taken by the rollout pump: one fresh
    # prompt for the step in training per entry (its target step), past admission and capacity
    refills: deque = field(default_factory=deque)
    # set once by the controller: stamped samplers dispatch no group for a target step >= this
    dispatch_limit: int = 0

    @property
    def wasted_samples(self) -> int:
        """Samples generated and never trained: aborted, dropped, evicted or set aside."""
        return self.rollout_stats.wasted_samples + self.train_stats.wasted_samples

    def requests(self) -> bool:
        """Whether a request waits for the rollout pump (refills, a stale abort)."""
        return bool(self.refills) or self.stale_at > self.stale_served

    def state_dict(self) -> dict:
        """The rollout pump's counters as checkpoints hold them (the train pump's wasted samples
        are saved with the train state)."""
        return {"stats": {k: v for k, v in asdict(self.rollout_stats).items() if k != "per_step_tokens"},
                "dropped_per_step": {str(k): v for k, v in self.dropped_per_step.items()}}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state["stats"].items():
            setattr(self.rollout_stats, k, v)
        self.dropped_per_step.clear()  # in place: the rollout pump holds this counter
        self.dropped_per_step.update({int(k): v for k, v in state.get("dropped_per_step", {}).items()})
