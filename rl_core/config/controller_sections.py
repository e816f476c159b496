"""Recipe sections of the asynchronous controller: samplers, rollout failure handling, the watchdog and `async_rl`.

Part of the recipe schema (`rl_core.config.schema` re-exports every name); no torch import."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from rl_core.config.base import Section, fail


# --------------------------------------------------------------------------- async controller


class AdaptiveStalenessConfig(Section):
    """Adaptive staleness bound of the `in_order` sampler (off by default): the lookahead moves between `min_lookahead_versions` and `max_lookahead_versions`, driven by the generation/trainer mismatch the train step measures (`metric`). After every RL step: if the step's metric is above `high_threshold` the bound narrows by one at once; if it stays below `low_threshold` for `patience_steps` consecutive steps the bound widens by one; in between it holds (hysteresis). A step whose groups were admitted under another bound is no evidence about the current one (no second narrowing, no low count, until the change reaches training). The bound decided after step t applies to dispatch from weight version t + 1 on; groups already dispatched under a wider bound still train (no generation is thrown away), so a narrowing reaches the trained staleness after at most the old bound's steps. The starting bound is the sampler's `max_lookahead_versions`. Logged every step as `async/staleness_bound`; checkpointed with the sampler."""

    enabled: bool = False
    """Turn the adaptive bound on (false: the bound is the fixed `max_lookahead_versions`)."""
    min_lookahead_versions: int = Field(1, ge=0)
    """Smallest bound the controller may narrow to. The default 1 is the recipe's default fixed bound (one-step-off), so turning the adaptive bound on never narrows below it; 0 lets it narrow to synchronous (slower, and on an engine whose logprobs match the trainer's the signal is then ~0, so it widens again after `patience_steps`; docs/controller.md, "Adaptive staleness")."""
    max_lookahead_versions: int = Field(4, ge=0)
    """Largest bound the controller may widen to; also sizes the dispatch limit and, in reproducible runs, the buffer."""
    metric: Literal["gen_train_kl", "gen_logprob_abs_error", "is_mult_prob_error"] = "gen_train_kl"
    """Mismatch signal, as logged under `train/`: `gen_train_kl` (k3 estimate of KL(pi_gen || pi_prev) per token), `gen_logprob_abs_error` (mean |logp_prev - logp_gen|), `is_mult_prob_error` (mean exp|logp_gen - logp_prev|, >= 1)."""
    low_threshold: float = Field(1.0e-3, ge=0)
    """Widen by one after `patience_steps` consecutive steps with the metric below this."""
    high_threshold: float = Field(3.0e-3, gt=0)
    """Narrow by one after any step with the metric above this."""
    patience_steps: int = Field(5, ge=1)
    """Consecutive low-mismatch steps needed to widen (counted again from 0 after every change and every step at or above low_threshold)."""

    @model_validator(mode="after")
    def _ordered(self):
        if self.min_lookahead_versions > self.max_lookahead_versions:
            fail("async_rl.sampler.adaptive.min_lookahead_versions", self.min_lookahead_versions,
                  f"at most async_rl.sampler.adaptive.max_lookahead_versions ({self.max_lookahead_versions})",
                  "lower min_lookahead_versions or raise max_lookahead_versions.")
        if self.low_threshold >= self.high_threshold:
            fail("async_rl.sampler.adaptive.low_threshold", self.low_threshold,
                  f"below async_rl.sampler.adaptive.high_threshold ({self.high_threshold}); the band between them is the hysteresis",
                  "lower low_threshold or raise high_threshold (e.g. 1.0e-3 and 3.0e-3 for gen_train_kl).")
        if self.metric == "is_mult_prob_error" and self.low_threshold < 1.0:
            fail("async_rl.sampler.adaptive.low_threshold", self.low_threshold,
                  ">= 1 with metric is_mult_prob_error (it is a mean of exp|logp_gen - logp_prev|, never below 1)",
                  "set thresholds above 1 (e.g. low 1.01, high 1.03), or use metric gen_train_kl.")
        return self


class PartialRolloutsConfig(Section):
    """Partial rollouts for the `in_order` sampler (off by default): a step does not wait for its stragglers. When the train pump needs a group of step s and none is ready, while a group of s is still generating and a group stamped for a later step t is ready, the two swap their steps: the ready group trains now in step s, the straggler keeps generating (across refits, every token records the weight version that produced it) and trains in step t when complete. A straggler is carried only while t - its dispatch version <= `max_staleness_versions` (the dispatch version is at most the version of its oldest token, so the bound holds for every token); beyond that it is not carried again and its step waits for it, as without partial rollouts. Nothing is aborted or wasted. Counted as `async/carried_groups` (per step) and `async/carried_groups_total`. Not with `reproducible`, nor with `adaptive`."""

    enabled: bool = False
    """Carry stragglers over to later steps instead of waiting for them."""
    max_staleness_versions: int = Field(2, ge=1)
    """Largest staleness (trainer version - dispatch version) a carried group may train with; above `max_lookahead_versions`, which bounds every group that is not carried."""


class InOrderSamplerConfig(Section):
    """Train step s on the groups dispatched for step s; dispatch for step s opens at weight version s - max_lookahead_versions."""

    type: Literal["in_order"] = "in_order"
    """Sampler type (registry key)."""
    max_lookahead_versions: int = 1
    """How many weight versions generation may run ahead of training: 0 = synchronous, 1 = one-step-off, ... Equals the largest staleness a trained group can have. With `adaptive.enabled`: the starting bound."""
    adaptive: AdaptiveStalenessConfig = AdaptiveStalenessConfig()
    """Move the bound with the measured generation/trainer mismatch (off by default)."""
    partial_rollouts: PartialRolloutsConfig = PartialRolloutsConfig()
    """Carry a step's stragglers over to a later step instead of waiting for them (off by default)."""

    @model_validator(mode="after")
    def _lookahead(self):
        if self.max_lookahead_versions < 0:
            fail("async_rl.sampler.max_lookahead_versions", self.max_lookahead_versions,
                  "an integer >= 0 (0 = synchronous, 1 = generation may run one version ahead)",
                  "set it to 0 for synchronous RL or to 1-4 for asynchronous RL.")
        ad = self.adaptive
        if ad.enabled and not ad.min_lookahead_versions <= self.max_lookahead_versions <= ad.max_lookahead_versions:
            fail("async_rl.sampler.max_lookahead_versions", self.max_lookahead_versions,
                  f"the starting bound of the adaptive sampler, between async_rl.sampler.adaptive.min_lookahead_versions "
                  f"({ad.min_lookahead_versions}) and max_lookahead_versions ({ad.max_lookahead_versions})",
                  "set async_rl.sampler.max_lookahead_versions inside the adaptive range, or widen the range.")
        pr = self.partial_rollouts
        if pr.enabled and ad.enabled:
            fail("async_rl.sampler.partial_rollouts.enabled", True,
                  "false while async_rl.sampler.adaptive.enabled is true (the adaptive rule reads each step's "
                  "staleness bound as evidence; carried groups train beyond it)",
                  "turn one of the two off.")
        if pr.enabled and pr.max_staleness_versions <= self.max_lookahead_versions:
            fail("async_rl.sampler.partial_rollouts.max_staleness_versions", pr.max_staleness_versions,
                  f"above async_rl.sampler.max_lookahead_versions ({self.max_lookahead_versions}): a straggler "
                  "of step s dispatched at version s - lookahead is carried to step s + 1 or later",
                  f"set it to {self.max_lookahead_versions + 1} or more, or turn partial_rollouts off.")
        return self

    def largest_lookahead(self) -> int:
        """The largest bound the sampler can ever use (the adaptive maximum when adaptive)."""
        return self.adaptive.max_lookahead_versions if self.adaptive.enabled else self.max_lookahead_versions

    def required_capacity(self, num_prompts_per_step: int, reproducible: bool) -> int:
        """Buffer slots the sampler needs (`InOrderSampler.required_capacity`, checked at recipe
        load): a reproducible refit barrier holds every group of the next `largest_lookahead()`
        steps, plus the step being trained; otherwise one step's groups."""
        return num_prompts_per_step * ((self.largest_lookahead() + 1) if reproducible else 1)


class WeightFifoSamplerConfig(Section):
    """Oldest weight version first (strict FIFO by version, waiting for its stragglers); ready groups older than the window are evicted."""

    type: Literal["weight_fifo"] = "weight_fifo"
    """Sampler type (registry key)."""
    max_staleness_versions: int = Field(1, ge=0)
    """Largest trainer_version - start_version of a trained group; also gates dispatch (batch b opens at version b - this)."""


class WindowedSamplerConfig(Section):
    """Any ready group inside the staleness window; aged groups are evicted and in-flight groups that leave the window are aborted. No admission gate: dispatch is bounded by capacity, the in-flight caps and over_sampling_ratio."""

    type: Literal["windowed"] = "windowed"
    """Sampler type (registry key)."""
    max_staleness_versions: int = Field(1, ge=0)
    """Largest trainer_version - start_version of a trained group."""
    sample_freshest_first: bool = False
    """Select the groups generated with the newest weights first (else in dispatch order)."""


class ReadyFirstSamplerConfig(Section):
    """Any ready group, mixed versions, in dispatch order; never evicts, so staleness is unbounded: needs importance-sampling correction."""

    type: Literal["ready_first"] = "ready_first"
    """Sampler type (registry key)."""
    max_staleness_versions: int = Field(1, ge=0)
    """Dispatch gate: batch b opens at trainer version b - this (bounds how far generation runs ahead)."""


class CustomSamplerConfig(Section):
    """A user sampler class: `rl-core validate` (and every command that loads the recipe) imports it, constructs it with `kwargs` and checks it against rl_core.samplers.base.Sampler before anything is built."""

    type: Literal["custom"] = "custom"
    """Sampler type (registry key)."""
    target: str = Field(..., pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """Import path 'module.path:ClassName'; constructed as ClassName(num_prompts_per_step=P, **kwargs)."""
    kwargs: dict[str, Any] = {}
    """Extra keyword arguments for the constructor."""


SamplerConfig = Annotated[
    Union[InOrderSamplerConfig, WeightFifoSamplerConfig, WindowedSamplerConfig, ReadyFirstSamplerConfig,
          CustomSamplerConfig],
    Field(discriminator="type"),
]


class RolloutFailureConfig(Section):
    """Resilience of the rollout pump: failure classes, retry budgets, deadlines, drop budgets."""

    max_infra_attempts_per_group: int | None = Field(None, ge=1)
    """Attempts of a group whose generation or episode failed for an infrastructure reason (timeout, dead backend or environment service, transport error, HTTP 5xx/408/429); null = no count limit (infra_retry_budget_s bounds the retries). Training and validation groups alike."""
    infra_retry_budget_s: float | None = Field(30.0, gt=0)
    """Seconds a group keeps retrying infrastructure failures, counted from its first one (with backoff in between); then its attempts are exhausted (dropped within max_dropped_groups, else the run stops). The default outlasts a restart of an HTTP environment service or generation server of a few seconds, mid-training or mid-validation; null = only max_infra_attempts_per_group bounds them."""
    max_data_attempts_per_group: int = Field(1, ge=1)
    """Attempts of a group that failed deterministically (bad data, an error in the agent, reward function or environment); counted apart from infra attempts."""
    backoff_base_s: float = Field(0.2, ge=0)
    """Infra retry delay: min(backoff_base_s * 2^(attempt-1), max_backoff_s), never past infra_retry_budget_s."""
    max_backoff_s: float = Field(2.0, ge=0)
    """Cap of the infra retry delay (a service that is back is used again at most this long after)."""
    generation_timeout_s: float | None = Field(None, gt=0)
    """Deadline of one sample's generation (null = none); a miss aborts the request and counts as an infra failure."""
    env_timeout_s: float | None = Field(None, gt=0)
    """Deadline of one environment scoring call (null = none); a miss counts as an infra failure."""
    max_dropped_groups: int = Field(0, ge=0)
    """Run-lifetime number of groups that may exhaust their attempts and be dropped; 0 = the first such failure stops the run. A validation may leave out as many held-out prompts (counted in its record as `dropped_prompts`)."""
    on_dropped_group: Literal["shrink", "replace"] = "shrink"
    """`shrink`: the step trains with fewer groups (down to min_step_batch_fraction); `replace`: a fresh prompt takes the dropped group's place (in_order: stamped with its step)."""
    min_step_batch_fraction: float = Field(0.75, gt=0, le=1)
    """A step may shrink only down to ceil(this * num_prompts_per_step) groups; below that the run stops."""
    max_train_step_retries: int = Field(1, ge=0)
    """Retries of an RL step whose training failed transiently (a microbatch raised, a non-finite gradient at the update): the step is reopened and its chunks replayed, up to this many times per RL step (PPO mini-steps share them). The previous-policy and reference logprob passes, the critic's value pass and the critic update are each retried up to this many times too. Used up: the run stops with TrainStepFailed and a checkpoint of the last good state (no trainer step left open)."""

    @model_validator(mode="after")
    def _infra_bounded(self):
        if self.max_infra_attempts_per_group is None and self.infra_retry_budget_s is None:
            fail("async_rl.failure.infra_retry_budget_s", None,
                 "a number of seconds, or a count in async_rl.failure.max_infra_attempts_per_group (with both null a "
                 "group whose service never comes back would retry forever)",
                 "set infra_retry_budget_s (default 30) or max_infra_attempts_per_group.")
        return self


class WatchdogConfig(Section):
    """Stall detection: no committed group and no RL step for stall_timeout_s."""

    interval_s: float = Field(10.0, gt=0)
    """How often the watchdog checks progress."""
    stall_timeout_s: float = Field(600.0, gt=0)
    """Report a stall after this long without progress; the report names what each pump waits on."""
    action: Literal["warn", "abort"] = "abort"
    """`warn`: print the report and keep waiting; `abort`: stop the run with a StallError carrying the report."""
    block_timeout_s: float = Field(60.0, gt=0)
    """An event loop that runs no callback for this long is blocked by code that does not await (`time.sleep`, a blocking client). The agents' loop: the run stops naming the function and file:line (BlockedLoopError). The controller's loop (e.g. a slow reward function scoring on it): a warning naming it, and with action abort the process ends at stall_timeout_s. The watchdog checks from a thread of its own."""


class AsyncRLConfig(Section):
    """The single controller: sampler (staleness policy) and backpressure valves."""

    sampler: SamplerConfig = InOrderSamplerConfig()
    """Which groups may train now, and how stale they may be."""
    max_inflight_groups: int = Field(32, ge=1)
    """Prompt groups being generated at once (group-level in-flight cap). While the pumps run, the garbage collector's gen-0 threshold is at least 100 allocations per in-flight group (metrics.gc_pauses), so a young collection does not re-traverse the waiting groups mid-step."""
    max_inflight_generations: int | None = Field(None, ge=1)
    """Samples being generated at once (generation-level backpressure): each sample takes a place when it starts and frees it when it finishes, so a slow sample does not hold back its group's other places. It also paces dispatch: a new group is dispatched only while fewer than one group's worth of samples waits for a place, so places are refilled at once without groups queueing (and ageing) behind the limit. null = only the group cap."""
    max_buffered_groups: int = Field(64, ge=1)
    """Buffer capacity: reserved + ready groups not yet selected for training."""
    min_groups_for_streaming_train: int = Field(1, ge=1)
    """Ready groups handed to the trainer per chunk (streaming: training starts before the step's last group is generated)."""
    over_sampling_ratio: float = Field(1.0, ge=1.0)
    """Unstamped samplers: at most ceil(ratio * groups the trainer can still consume within the staleness window) groups may be live; 1 = no over-sampling. Wasted (evicted/aborted) generations are counted."""
    refit_mode: Literal["in_flight", "drain"] | None = None
    """`in_flight`: swap weights while generations run (each sample records start and end versions); `drain`: let in-flight generations finish first, so no sample spans two versions; null = `in_flight`, or the reproducible barrier when `reproducible: true`."""
    recompute_kv_cache_after_weight_updates: bool = False
    """After each refit, make every generation backend recompute (or drop) KV cache entries computed with older weights."""
    reproducible: bool = False
    """Reproducible asynchronous RL: every group of step s is generated entirely with weight version max(0, s - max_lookahead_versions) (refit waits for them: a barrier), samples use per-sample seeds, and each step trains its groups in dispatch order. The same recipe then gives the same weights, run after run and across kill/resume. Needs the `in_order` sampler."""
    failure: RolloutFailureConfig = RolloutFailureConfig()
    """Retries, deadlines and drop budgets."""
    watchdog: WatchdogConfig = WatchdogConfig()
    """Stall watchdog."""
