"""Recipe sections of the RL algorithm: `grpo` (step sizes), `advantage`, `loss`, reward shaping, dynamic sampling and the PPO `critic`.

Part of the recipe schema (`rl_core.config.schema` re-exports every name); no torch import."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rl_core.config.base import Section, fail


# --------------------------------------------------------------------------- algorithm


class GRPOConfig(Section):
    """The RL loop's counts (GRPO-style: groups of samples per prompt)."""

    num_prompts_per_step: int = Field(16, ge=1)
    """Prompt groups trained per RL step."""
    num_generations_per_prompt: int = 8
    """Samples per prompt (the group size); GRPO's baseline needs at least 2."""
    max_num_steps: int = Field(600, ge=1)
    """Stop after this many RL steps (also bounded by max_num_epochs)."""
    max_num_epochs: int | None = Field(None, ge=1)
    """Passes over the training prompts on the rollout side; null = unbounded."""
    seed: int = Field(0, ge=0, le=2**64 - 1)
    """Seed of data order, sampling and initialisation (0 .. 2**64 - 1, the range torch's generators take)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each RL step's batch of rollouts (PPO epochs); the previous-policy logprobs stay fixed across them."""
    num_minibatches: int = Field(1, ge=1)
    """Optimizer steps per pass: the batch is split into this many shuffled minibatches. An RL step then holds ppo_epochs * num_minibatches optimizer steps (counted apart from RL steps)."""

    @property
    def samples_per_step(self) -> int:
        """Samples of one RL step: num_prompts_per_step * num_generations_per_prompt."""
        return self.num_prompts_per_step * self.num_generations_per_prompt

    @property
    def optimizer_steps_per_rl_step(self) -> int:
        """Optimizer steps (mini-steps) of one RL step: ppo_epochs * num_minibatches."""
        return self.ppo_epochs * self.num_minibatches

    @model_validator(mode="after")
    def _group(self):
        if self.num_minibatches > self.samples_per_step:
            fail("grpo.num_minibatches", self.num_minibatches,
                  f"at most the samples of one step ({self.samples_per_step})",
                  "lower grpo.num_minibatches.")
        if self.num_generations_per_prompt < 2:
            fail("grpo.num_generations_per_prompt", self.num_generations_per_prompt,
                  "an integer >= 2 (GRPO normalises each sample's reward against the other samples of its prompt)",
                  "set grpo.num_generations_per_prompt to 2 or more (8 is typical).")
        return self


class AdvantageConfig(Section):
    """How rewards become advantages: one per sample, or one per token (`gae`, token-level KL in the reward).

    A knob that only one estimator reads (listed before its description) raises when set to
    a non-default value under another estimator: nothing is silently ignored.
    """

    estimator: Literal["grpo", "gdpo", "reinforce_pp", "raw_reward", "gae"] = "grpo"
    """`grpo`: reward minus the group baseline, optionally divided by the group's std (Shao et al. 2024); `gdpo`: every named reward component normalised per group like grpo, summed with `reward_weights`, then whitened over the batch (Liu et al. 2026, arXiv:2601.05242); `reinforce_pp`: reward minus the group mean, whitened over the batch (REINFORCE++-baseline, Hu 2025, arXiv:2501.03262); `raw_reward`: the reward itself, optionally whitened; `gae`: generalised advantage estimation on a learned critic's values (PPO; needs `critic.enabled`)."""
    baseline: Literal["mean", "leave_one_out"] = "mean"
    """grpo, gdpo: group baseline: the group mean, or the mean of the other samples (leave-one-out, unbiased)."""
    normalize_std: bool = True
    """grpo, gdpo: divide by the group's reward standard deviation (+std_eps); groups of identical rewards get 0."""
    std_of: Literal["group", "others"] = "group"
    """grpo, gdpo with normalize_std: whose reward standard deviation divides sample i's advantage: `group` = the Bessel-corrected std of all the group's samples (GRPO); `others` = the Bessel-corrected std of the other samples of i's group, matching `baseline: leave_one_out` (NeMo RL's leave-one-out baseline and std); where the others have no spread (all equal, or fewer than two) the advantage is only centred. `others` needs baseline leave_one_out."""
    exclude_invalid_from_stats: bool = False
    """Keep invalid samples (excluded from the loss by the environment's mask or overlong filtering, or aborted) out of the group statistics (baseline, std) and of batch whitening; they get advantage 0. false = every sample counts in its group's statistics (today's behaviour). NeMo RL's valid mask in its per-prompt baseline."""
    std_eps: float = Field(1e-6, gt=0)
    """Added to a standard deviation before dividing by it (group std and batch whitening)."""
    reward_weights: dict[str, float] = {}
    """gdpo: weight of each named reward component (the environment's `rewards`, e.g. {correct: 1.0, format: 0.5}); empty = every component the environment reports, weight 1; otherwise exactly the listed components."""
    subtract_group_mean: bool = True
    """reinforce_pp: subtract each group's mean reward before whitening (REINFORCE++-baseline); false = plain REINFORCE++ (whiten the rewards themselves)."""
    whiten: bool = True
    """raw_reward, reinforce_pp, gae: whiten the advantages over the samples (tokens, when advantages are per token) of one call: subtract the mean, divide by std + std_eps; zero spread is only mean-centred."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """gae: discount per token."""
    lam: float = Field(0.95, ge=0.0, le=1.0)
    """gae: lambda of the policy's advantages (0 = one-step TD error, 1 = return minus value)."""
    value_lam: float | None = Field(None, ge=0.0, le=1.0)
    """gae: lambda of the critic's return targets (returns = GAE(value_lam) + V); null = same as `lam` (VAPO uses 1.0)."""
    length_adaptive_alpha: float | None = Field(None, gt=0.0)
    """gae: per-sequence policy lambda = 1 - 1 / (alpha * completion length), replacing `lam` (VAPO, Yue et al. 2025, arXiv:2504.05118, alpha 0.05); null = off."""
    bootstrap_truncated: bool = False
    """gae: for a completion cut at the token limit (finish reason `length`) the value after its last token is the critic's value of that state, not 0 (partial-episode bootstrapping, Pardo et al. 2018, "Time limits in reinforcement learning"); false = every completion ends the episode (value 0 after it)."""
    kl_in_reward_coef: float = Field(0.0, ge=0.0)
    """Penalise the reward by this times the KL to the reference policy (KL in the reward, Ouyang et al. 2022); 0 = off. Cannot be combined with loss.kl_coef > 0."""
    kl_in_reward_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Estimator of the KL reward penalty (see loss.kl_estimator)."""
    kl_in_reward_level: Literal["token", "sequence"] = "sequence"
    """`sequence`: the sample's reward gets -coef * sum_t KL_t before the estimator runs; `token`: token t's reward gets -coef * KL_t (needs a per-token return: reinforce_pp or gae)."""

    @model_validator(mode="after")
    def _estimator_knobs(self):
        only = {"baseline": ("grpo", "gdpo"), "normalize_std": ("grpo", "gdpo"), "std_of": ("grpo", "gdpo"),
                "reward_weights": ("gdpo",), "subtract_group_mean": ("reinforce_pp",),
                "whiten": ("raw_reward", "reinforce_pp", "gae"), "gamma": ("gae",), "lam": ("gae",),
                "value_lam": ("gae",), "length_adaptive_alpha": ("gae",), "bootstrap_truncated": ("gae",)}
        for name, estimators in only.items():
            value = getattr(self, name)
            if self.estimator not in estimators and value != type(self).model_fields[name].default:
                fail(f"advantage.{name}", value,
                      f"its default ({type(self).model_fields[name].default!r}) under estimator '{self.estimator}' "
                      f"(only {', '.join(estimators)} read it)",
                      f"remove advantage.{name}, or set advantage.estimator to {' or '.join(estimators)}.")
        if self.std_of == "others" and (self.baseline != "leave_one_out" or not self.normalize_std):
            fail("advantage.std_of", "others",
                  "'group' unless advantage.baseline is leave_one_out and advantage.normalize_std is true (the std of "
                  "the other samples goes with their mean as the baseline)",
                  "set advantage.baseline: leave_one_out and advantage.normalize_std: true, or remove advantage.std_of.")
        if self.reward_weights and not any(w != 0 for w in self.reward_weights.values()):
            fail("advantage.reward_weights", self.reward_weights, "at least one non-zero weight",
                  "give the components that matter a positive weight (e.g. {correct: 1.0}).")
        if self.kl_in_reward_coef > 0:
            if self.estimator == "gdpo":
                fail("advantage.kl_in_reward_coef", self.kl_in_reward_coef,
                      "0 under estimator 'gdpo' (GDPO normalises each named component per group; a KL penalty is not one of them)",
                      "use loss.kl_coef for a KL term with gdpo, or another estimator.")
            if self.kl_in_reward_level == "token" and self.estimator not in ("reinforce_pp", "gae"):
                fail("advantage.kl_in_reward_level", "token",
                      f"'sequence' under estimator '{self.estimator}' (it turns one reward per sample into one advantage per sample)",
                      "set advantage.kl_in_reward_level: sequence, or use estimator reinforce_pp or gae (per-token returns).")
        return self


class ImportanceSamplingConfig(Section):
    """Correction for the gap between the generation engine's and the trainer's logprobs."""

    enabled: bool = True
    """Weight each token's loss by exp(trainer_logprob - generation_logprob) (detached)."""
    level: Literal["token", "sequence"] = "token"
    """Weight per token, or one weight per sequence (exp of the summed log-ratio); `seq-mask-tis` needs `sequence`."""
    truncation: Literal["none", "tis", "icepop", "seq-mask-tis"] = "tis"
    """`tis`: clamp the weight to [min_ratio, max_ratio]; `icepop`: weight 0 where it is out of that range; `seq-mask-tis`: weight 0 on every token of a sequence whose geometric-mean ratio is out of range, raw token weights elsewhere; `none`: the raw weight."""
    min_ratio: float = Field(0.0, ge=0.0)
    """Lower end of the accepted weight range."""
    max_ratio: float = Field(2.0, gt=0.0)
    """Upper end of the accepted weight range."""
    max_seq_mult_prob_error: float | None = Field(None, gt=1.0)
    """Drop from the loss (mask 0) every sequence whose mean over tokens of exp(|generation_logprob - trainer_logprob|) exceeds this (e.g. 1.5); null = keep all. Applies whether or not `enabled`."""

    @model_validator(mode="after")
    def _range(self):
        if self.max_ratio <= self.min_ratio:
            fail("loss.importance_sampling.max_ratio", self.max_ratio,
                  f"a value above loss.importance_sampling.min_ratio ({self.min_ratio})",
                  "raise max_ratio (2.0 is common) or lower min_ratio.")
        if self.truncation == "seq-mask-tis" and self.level != "sequence":
            fail("loss.importance_sampling.level", self.level,
                  "'sequence' with truncation 'seq-mask-tis' (it decides per sequence on the geometric-mean ratio; kept sequences use their raw token weights)",
                  "set loss.importance_sampling.level: sequence, or truncation: icepop to drop single tokens.")
        return self


class LossConfig(Section):
    """The policy loss."""

    type: Literal["clipped_pg", "reinforce"] = "clipped_pg"
    """`clipped_pg`: PPO-style clipped policy gradient (Schulman et al. 2017, eq. 7); `reinforce`: plain policy gradient -A * logprob (no ratio, no clipping)."""
    clip_eps_low: float = Field(0.2, ge=0.0)
    """clipped_pg: lower clip of the ratio: 1 - clip_eps_low."""
    clip_eps_high: float = Field(0.2, ge=0.0)
    """clipped_pg: upper clip of the ratio: 1 + clip_eps_high (DAPO's clip-higher uses 0.28)."""
    dual_clip_c: float | None = Field(None, gt=1.0)
    """clipped_pg: dual clip (Ye et al. 2020): for negative advantages the loss is capped at -c * A (c > 1, e.g. 3); null = off."""
    ratio_level: Literal["token", "sequence"] = "token"
    """clipped_pg: `token`: one ratio per token (PPO); `sequence`: the geometric mean of a sequence's token ratios on each of its tokens (GSPO, Zheng et al. 2025; needs aggregation: sequence and much smaller clip_eps, e.g. 3e-4/4e-4)."""
    aggregation: Literal["token", "sequence"] = "token"
    """`token`: sum over all valid tokens of the step / their count; `sequence`: per-sequence mean, then mean over sequences."""
    empty_sequences: Literal["drop", "zero"] = "drop"
    """aggregation sequence: a sequence with no trained token (every token masked: an excluded sample, an empty completion) is left out of the mean over sequences (`drop`), or counts as a loss of 0 (`zero`: the mean is over every sequence of the step, as verl's `seq-mean-token-mean` divides by the batch size)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL penalty to the reference (initial) policy as a loss term; 0 = off. Cannot be combined with advantage.kl_in_reward_coef > 0."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman, 'Approximating KL divergence', 2020)."""
    kl_input_clamp: float | None = Field(20.0, gt=0.0)
    """Clamp the log-ratio log(pi_ref / pi) to +-this before the KL estimator (null = no clamp)."""
    kl_output_clamp: float | None = Field(10.0, gt=0.0)
    """Clamp each token's KL estimate to +-this (null = no clamp)."""
    importance_sampling: ImportanceSamplingConfig = ImportanceSamplingConfig()
    """Off-policy correction between generation and trainer logprobs."""

    @model_validator(mode="after")
    def _loss_knobs(self):
        if self.type == "reinforce":
            for name in ("clip_eps_low", "clip_eps_high", "dual_clip_c", "ratio_level"):
                value, default = getattr(self, name), type(self).model_fields[name].default
                if value != default:
                    fail(f"loss.{name}", value, f"its default ({default!r}) with loss.type 'reinforce' (no ratio, no clipping)",
                          f"remove loss.{name}, or set loss.type: clipped_pg.")
        if self.empty_sequences != "drop" and self.aggregation != "sequence":
            fail("loss.empty_sequences", self.empty_sequences,
                  "'drop' with loss.aggregation 'token' (a sequence without trained tokens adds nothing to a token mean)",
                  "set loss.aggregation: sequence, or remove loss.empty_sequences.")
        if self.ratio_level == "sequence" and self.aggregation != "sequence":
            fail("loss.aggregation", self.aggregation,
                  "'sequence' with loss.ratio_level 'sequence' (GSPO's objective averages one clipped ratio per sequence; token aggregation would weight each sequence by its length)",
                  "set loss.aggregation: sequence, or loss.ratio_level: token.")
        return self


class OverlongPenaltyConfig(Section):
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), added to the reward."""

    enabled: bool = False
    """Add the length penalty to every sample's reward."""
    max_response_tokens: int | None = Field(None, ge=1)
    """L_max: completions this long get the full penalty; null = generation.max_tokens."""
    buffer_tokens: int | None = Field(None, ge=1)
    """L_cache: the penalty ramps linearly from 0 at L_max - L_cache tokens to -penalty at L_max; null = L_max // 5 (DAPO: 4096 of 20480)."""
    penalty: float = Field(1.0, gt=0.0)
    """Penalty at L_max tokens (and beyond, unless `saturate` is false)."""
    saturate: bool = True
    """true: the penalty stays at -penalty beyond L_max tokens (DAPO eq. 13); false (unsaturated): the linear ramp continues past L_max without a floor, -penalty * (l - (L_max - L_cache)) / L_cache (the DAPO reference code, verl's DAPORewardManager). Only completions longer than L_max differ: set max_response_tokens below generation.max_tokens, or multi-turn completions with observations."""


class RewardScalingConfig(Section):
    """Clamp the environment's reward to [source_min, source_max], then map that range linearly onto [target_min, target_max]."""

    enabled: bool = False
    """Scale every sample's reward (before the overlong penalty is added)."""
    source_min: float = 0.0
    """Lower end of the environment's reward range (smaller rewards are clamped to it)."""
    source_max: float = 1.0
    """Upper end of the environment's reward range (larger rewards are clamped to it)."""
    target_min: float = 0.0
    """What source_min maps to."""
    target_max: float = 1.0
    """What source_max maps to."""

    @model_validator(mode="after")
    def _ranges(self):
        if self.source_max <= self.source_min:
            fail("reward_shaping.scaling.source_max", self.source_max, f"a value above source_min ({self.source_min})",
                  "set the environment's reward range, e.g. source_min: 0, source_max: 1.")
        if self.target_max == self.target_min:
            fail("reward_shaping.scaling.target_max", self.target_max,
                  f"a value other than target_min ({self.target_min}) (equal ends make every reward the same)",
                  "set target_min and target_max to the range you want, e.g. -1 and 1.")
        return self


class DynamicSamplingConfig(Section):
    """DAPO dynamic sampling (Yu et al. 2025): drop prompt groups whose rewards are all equal (zero advantage) and refill the step with fresh groups."""

    enabled: bool = False
    """Drop zero-variance groups (decided on the environment's reward before shaping, or on every named component under gdpo)."""
    max_num_dropped_groups_per_step: int | None = Field(None, ge=0)
    """The RL step fails with an error once more groups than this were dropped while filling it (the task is too easy or too hard); null = 10 x grpo.num_prompts_per_step."""


class RewardShapingConfig(Section):
    """Reward shaping and filtering applied to every committed group before advantages."""

    overlong_filtering: bool = False
    """Exclude truncated samples (finish reason `length`) from the loss; they still count in their group's baseline."""
    overlong_penalty: OverlongPenaltyConfig = OverlongPenaltyConfig()
    """DAPO length penalty."""
    scaling: RewardScalingConfig = RewardScalingConfig()
    """Reward scaling (clamp, then linear map)."""
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    """Zero-variance group filtering with refill."""


class CriticConfig(Section):
    """PPO's value model: a separate causal-LM backbone with a scalar head (`rl_core.train.critic`), trained with a clipped value loss.

    A value head on the policy's own backbone is not offered: the critic always has its own
    weights and optimizer.
    """

    enabled: bool = False
    """Train a critic (needed by advantage.estimator: gae)."""
    model_path: str | None = None
    """HF causal-LM directory whose backbone the critic starts from (its LM head is dropped; a fresh scalar head is added), or a directory saved by the critic; null = the initial policy."""
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate of the critic."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay of the critic."""
    microbatch_size: int = Field(64, ge=1)
    """Samples per critic forward/backward pass."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the critic's gradient norm to this (null = no clipping)."""
    value_clip_eps: float | None = Field(0.2, gt=0)
    """PPO value clipping: the loss is max((V - R)^2, (V_old + clip(V - V_old, +-eps) - R)^2) / 2; null = plain squared error. In reward units."""
    num_warmup_steps: int = Field(0, ge=0)
    """RL steps at the start of training in which only the critic is updated (the policy is not)."""
