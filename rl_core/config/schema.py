"""The recipe schema: pydantic models for every knob of an rl_core run.

Owns: field names, types, defaults, per-field docs (attribute docstrings become the
field descriptions, which `rl-core docs` prints), and cross-field rules that can be
checked from the recipe alone. Validators check and never mutate.

Does not own: reading YAML, command-line overrides, file-system preflight or error
formatting (see `loader.py`), and it never imports torch: loading a recipe must stay
cheap so that a bad recipe fails before any model is built.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, docstrings are docs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


def _fail(field: str, value, expected: str, fix: str):
    # Raised inside validators; the loader turns it into a RecipeError paragraph.
    from rl_core.errors import RecipeError

    raise RecipeError.single(field, value, expected, fix)


# --------------------------------------------------------------------------- model


class TinyModelConfig(Section):
    """Shape of the random-init model built by `init_policy` when `model.source: tiny`."""

    architecture: Literal["qwen2", "llama"] = "qwen2"
    """transformers architecture used to build the config (Qwen2Config or LlamaConfig)."""
    hidden_size: int = Field(128, ge=8)
    """Width of the residual stream."""
    num_hidden_layers: int = Field(2, ge=1)
    """Number of decoder layers."""
    num_attention_heads: int = Field(4, ge=1)
    """Query heads per layer; must divide hidden_size."""
    num_key_value_heads: int = Field(4, ge=1)
    """Key/value heads per layer (grouped-query attention); must divide num_attention_heads."""
    intermediate_size: int = Field(512, ge=8)
    """Width of the SwiGLU MLP."""
    max_position_embeddings: int = Field(64, ge=8)
    """Longest sequence (prompt + completion, in tokens) the model supports."""
    tie_word_embeddings: bool = False
    """Share the input embedding and the LM head (with a ~300-token vocabulary, untied embeddings warm up ~5x faster and far more reliably across seeds)."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base frequency."""
    tokenizer_vocab_size: int = Field(300, ge=260)
    """Target vocabulary of the byte-level BPE tokenizer trained on the task text (>= 256 bytes + specials)."""

    @model_validator(mode="after")
    def _heads(self):
        if self.hidden_size % self.num_attention_heads:
            _fail("model.tiny.num_attention_heads", self.num_attention_heads,
                  f"a divisor of model.tiny.hidden_size ({self.hidden_size})",
                  "pick a head count that divides the hidden size, e.g. 4 for 128.")
        if self.num_attention_heads % self.num_key_value_heads:
            _fail("model.tiny.num_key_value_heads", self.num_key_value_heads,
                  f"a divisor of model.tiny.num_attention_heads ({self.num_attention_heads})",
                  "set it equal to num_attention_heads (no GQA) or to one of its divisors.")
        return self


class WarmupConfig(Section):
    """Supervised warm-up of a fresh tiny model so that RL starts from a low, non-zero accuracy."""

    enabled: bool = True
    """Run the warm-up (only used when `model.source: tiny`)."""
    lr: float = Field(1e-3, gt=0)
    """AdamW learning rate of the warm-up."""
    batch_size: int = Field(128, ge=1)
    """Examples per warm-up step."""
    max_steps: int = Field(3000, ge=1)
    """Give up after this many steps even if the target accuracy is not reached."""
    target_accuracy: float = Field(0.10, ge=0.0, le=1.0)
    """Stop at the first check whose greedy held-out accuracy reaches this (accuracy jumps sharply, so stop on it, not on a step count)."""
    eval_every_steps: int = Field(10, ge=1)
    """Check the held-out accuracy every this many steps."""
    num_eval_prompts: int = Field(200, ge=1)
    """Held-out prompts used by each warm-up check."""


class ModelConfig(Section):
    """The policy: where it comes from and its numeric type."""

    source: Literal["tiny", "hf"] = "tiny"
    """`tiny`: build a random-init model + tokenizer from `model.tiny` and warm it up; `hf`: load the HF directory at `model.path`."""
    path: str | None = None
    """HF model directory (config.json, safetensors, tokenizer) when `source: hf`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of trainer and generation (keep float32 on CPU)."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the tiny model (source: tiny)."""
    warmup: WarmupConfig = WarmupConfig()
    """Supervised warm-up (source: tiny)."""

    @model_validator(mode="after")
    def _path(self):
        if self.source == "hf" and not self.path:
            _fail("model.path", self.path, "an HF model directory when model.source is 'hf'",
                  "set model.path to a directory holding config.json and *.safetensors, or use model.source: tiny.")
        return self


# --------------------------------------------------------------------------- data / env


class DataConfig(Section):
    """Prompt datasets (JSON lines, one example per line)."""

    train_file: str = "data/addition/train.jsonl"
    """Training prompts; relative paths are resolved against the working directory."""
    val_file: str = "data/addition/val.jsonl"
    """Held-out prompts used by validation."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (seeded by grpo.seed and the epoch number)."""
    max_train_examples: int | None = Field(None, ge=1)
    """Use only the first N training examples (an epoch is then N // num_prompts_per_step steps); null = all."""


class AdditionEnvConfig(Section):
    """Multi-digit addition: reward 1 for the exact (reversed-digit) answer followed by the end token."""

    type: Literal["addition"] = "addition"
    """Environment type (registry key)."""
    format_reward: float = Field(0.0, ge=0.0)
    """Extra reward for a well-formed answer (right number of digits, then end), whatever its value; 0 = off."""


EnvConfig = Annotated[Union[AdditionEnvConfig], Field(discriminator="type")]


# --------------------------------------------------------------------------- generation


class SamplingParamsConfig(Section):
    """Sampling parameters of one generation request."""

    temperature: float = Field(1.0, ge=0.0)
    """Softmax temperature; 0 means greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest token set with this much probability (1 = off)."""
    top_k: int = Field(0, ge=0)
    """Keep only the k most likely tokens (0 = off)."""
    greedy: bool = False
    """Always take the most likely token (overrides temperature/top_p/top_k)."""
    max_tokens: int = Field(8, ge=1)
    """Most new tokens per sample."""
    stop: list[str] = []
    """Extra stop strings; generation also stops at the tokenizer's end token."""


class GenerationConfig(SamplingParamsConfig):
    """Generation backend and the sampling parameters of training rollouts."""

    backend: Literal["native"] = "native"
    """Which backend generates rollouts: `native` (rl_core's own torch engine, in process)."""
    max_batch_size: int = Field(256, ge=1)
    """Most sequences the engine decodes in one batch."""


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
    seed: int = 0
    """Seed of data order, sampling and initialisation."""

    @model_validator(mode="after")
    def _group(self):
        if self.num_generations_per_prompt < 2:
            _fail("grpo.num_generations_per_prompt", self.num_generations_per_prompt,
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
    kl_in_reward_coef: float = Field(0.0, ge=0.0)
    """Penalise the reward by this times the KL to the reference policy (KL in the reward, Ouyang et al. 2022); 0 = off. Cannot be combined with loss.kl_coef > 0."""
    kl_in_reward_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Estimator of the KL reward penalty (see loss.kl_estimator)."""
    kl_in_reward_level: Literal["token", "sequence"] = "sequence"
    """`sequence`: the sample's reward gets -coef * sum_t KL_t before the estimator runs; `token`: token t's reward gets -coef * KL_t (needs a per-token return: reinforce_pp or gae)."""

    @model_validator(mode="after")
    def _estimator_knobs(self):
        only = {"baseline": ("grpo", "gdpo"), "normalize_std": ("grpo", "gdpo"), "reward_weights": ("gdpo",),
                "subtract_group_mean": ("reinforce_pp",), "whiten": ("raw_reward", "reinforce_pp", "gae"),
                "gamma": ("gae",), "lam": ("gae",), "value_lam": ("gae",), "length_adaptive_alpha": ("gae",)}
        for name, estimators in only.items():
            value = getattr(self, name)
            if self.estimator not in estimators and value != type(self).model_fields[name].default:
                _fail(f"advantage.{name}", value,
                      f"its default ({type(self).model_fields[name].default!r}) under estimator '{self.estimator}' "
                      f"(only {', '.join(estimators)} read it)",
                      f"remove advantage.{name}, or set advantage.estimator to {' or '.join(estimators)}.")
        if self.reward_weights and not any(w != 0 for w in self.reward_weights.values()):
            _fail("advantage.reward_weights", self.reward_weights, "at least one non-zero weight",
                  "give the components that matter a positive weight (e.g. {correct: 1.0}).")
        if self.kl_in_reward_coef > 0:
            if self.estimator == "gdpo":
                _fail("advantage.kl_in_reward_coef", self.kl_in_reward_coef,
                      "0 under estimator 'gdpo' (GDPO normalises each named component per group; a KL penalty is not one of them)",
                      "use loss.kl_coef for a KL term with gdpo, or another estimator.")
            if self.kl_in_reward_level == "token" and self.estimator not in ("reinforce_pp", "gae"):
                _fail("advantage.kl_in_reward_level", "token",
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
            _fail("loss.importance_sampling.max_ratio", self.max_ratio,
                  f"a value above loss.importance_sampling.min_ratio ({self.min_ratio})",
                  "raise max_ratio (2.0 is common) or lower min_ratio.")
        if self.truncation == "seq-mask-tis" and self.level != "sequence":
            _fail("loss.importance_sampling.level", self.level,
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
                    _fail(f"loss.{name}", value, f"its default ({default!r}) with loss.type 'reinforce' (no ratio, no clipping)",
                          f"remove loss.{name}, or set loss.type: clipped_pg.")
        if self.ratio_level == "sequence" and self.aggregation != "sequence":
            _fail("loss.aggregation", self.aggregation,
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
    """Penalty at L_max tokens and beyond."""


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
            _fail("reward_shaping.scaling.source_max", self.source_max, f"a value above source_min ({self.source_min})",
                  "set the environment's reward range, e.g. source_min: 0, source_max: 1.")
        if self.target_max == self.target_min:
            _fail("reward_shaping.scaling.target_max", self.target_max,
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


# Options the algorithm library implements but the controller does not apply yet (issue 5,
# phase 2: the train pump wires them). A recipe asking for one fails at load instead of
# being silently ignored. Remove an entry in the change that wires it.
_PENDING_CONTROLLER_WIRING: tuple[tuple[str, str], ...] = (
    ("advantage.estimator", "gdpo"),
    ("advantage.estimator", "gae"),
    ("advantage.kl_in_reward_coef", "> 0"),
    ("critic.enabled", "true"),
    ("reward_shaping.overlong_filtering", "true"),
    ("reward_shaping.overlong_penalty.enabled", "true"),
    ("reward_shaping.scaling.enabled", "true"),
    ("reward_shaping.dynamic_sampling.enabled", "true"),
)


def _requested(cfg, path: str, when: str) -> tuple[bool, object]:
    node = cfg
    for part in path.split("."):
        node = getattr(node, part)
    if when == "true":
        return bool(node), node
    if when == "> 0":
        return node > 0, node
    return node == when, node


# --------------------------------------------------------------------------- async controller


class InOrderSamplerConfig(Section):
    """Train step s on the groups dispatched for step s; dispatch for step s opens at weight version s - max_lookahead_versions."""

    type: Literal["in_order"] = "in_order"
    """Sampler type (registry key)."""
    max_lookahead_versions: int = 1
    """How many weight versions generation may run ahead of training: 0 = synchronous, 1 = one-step-off, ... Equals the largest staleness a trained group can have."""

    @model_validator(mode="after")
    def _lookahead(self):
        if self.max_lookahead_versions < 0:
            _fail("async_rl.sampler.max_lookahead_versions", self.max_lookahead_versions,
                  "an integer >= 0 (0 = synchronous, 1 = generation may run one version ahead)",
                  "set it to 0 for synchronous RL or to 1-4 for asynchronous RL.")
        return self


SamplerConfig = Annotated[Union[InOrderSamplerConfig], Field(discriminator="type")]


class AsyncRLConfig(Section):
    """The single controller: sampler (staleness policy) and backpressure valves."""

    sampler: SamplerConfig = InOrderSamplerConfig()
    """Which groups may train now, and how stale they may be."""
    max_inflight_groups: int = Field(32, ge=1)
    """Prompt groups being generated at once (the in-flight cap)."""
    max_buffered_groups: int = Field(64, ge=1)
    """Buffer capacity: reserved + ready groups not yet selected for training."""
    min_groups_for_streaming_train: int = Field(1, ge=1)
    """Ready groups handed to the trainer per chunk (streaming: training starts before the step's last group is generated)."""
    refit_mode: Literal["in_flight", "drain"] | None = None
    """`in_flight`: swap weights while generations run (each sample records start and end versions); `drain`: let in-flight generations finish first, so no sample spans two versions; null = `in_flight`, or the reproducible barrier when `reproducible: true`."""
    reproducible: bool = False
    """Reproducible asynchronous RL: every group of step s is generated entirely with weight version max(0, s - max_lookahead_versions) (refit waits for them: a barrier), samples use per-sample seeds, and each step trains its groups in dispatch order. The same recipe then gives the same weights, run after run and across kill/resume. Needs the `in_order` sampler."""


# --------------------------------------------------------------------------- trainer


class FSDPConfig(Section):
    """`trainer.backend: fsdp2`: torch FSDP2 (`fully_shard`, DTensor parameters), one process per device."""

    mixed_precision: Literal["auto", "bf16", "none"] = "auto"
    """`bf16`: bf16 parameters and compute, fp32 gradient reduction, fp32 master weights and optimizer (GPU only); `none`: everything in model.dtype; `auto`: bf16 on GPU, none on CPU."""
    reshard_after_forward: bool = True
    """Free each layer's gathered parameters after its forward and gather them again in backward (ZeRO-3 memory); false keeps them until backward (less communication, more memory)."""
    data_parallel_replicate_size: int = Field(1, ge=1)
    """HSDP: number of model replicas; each shards the model over world_size / this many processes (1 = plain FSDP over all processes)."""


class MegatronConfig(Section):
    """`trainer.backend: megatron`: Megatron-core GPTModel (local layer spec) with weights converted from and back to the HF layout."""

    tensor_model_parallel_size: int = Field(1, ge=1)
    """Tensor parallel size (splits attention heads, MLP width and vocabulary); must divide the number of key/value heads."""
    pipeline_model_parallel_size: int = Field(1, ge=1)
    """Pipeline parallel size; only 1 is supported (the split step API streams chunks that a pipeline schedule would reorder)."""
    mixed_precision: Literal["auto", "bf16", "none"] = "auto"
    """`bf16`: bf16 parameters and compute with fp32 main weights in Megatron's optimizer (GPU only); `none`: model.dtype; `auto`: bf16 on GPU, none on CPU."""
    optimizer: Literal["auto", "megatron", "torch"] = "auto"
    """`megatron`: Megatron's optimizer (fp32 main params, fused Adam; GPU only); `torch`: torch AdamW on Megatron's gradient buffers; `auto`: megatron on GPU, torch on CPU."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1; needs optimizer `megatron`)."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and all-reduce gradients in fp32 even when parameters are bf16."""


class WeightSyncConfig(Section):
    """How new weights reach the generation backends at refit."""

    type: Literal["in_process", "filesystem"] = "in_process"
    """`in_process`: hand the state dict to in-process engines; `filesystem`: write a versioned safetensors directory plus a ready marker that engines load (works across processes and nodes with a shared file system). NCCL/gloo broadcast to remote generation processes (`rl_core.weights.broadcast`) is wired by remote generation backends."""
    dir: str | None = None
    """Root of the versioned weight directories (`filesystem`); null = <run dir>/weights."""
    keep_last_versions: int = Field(2, ge=1)
    """Versions kept on disk (`filesystem`); older ones are deleted once a newer one is ready."""


class TrainerConfig(Section):
    """The training backend and its optimizer."""

    backend: Literal["torch", "fsdp2", "megatron"] = "torch"
    """`torch`: one process, plain PyTorch (CPU or one GPU); `fsdp2`: torch FSDP2 over N processes (one per device; gloo on CPU, NCCL on GPU); `megatron`: Megatron-core GPTModel (Qwen2/Llama) with tensor and data parallelism."""
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW beta2."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    microbatch_size: int = Field(64, ge=1)
    """Samples per forward/backward pass (per process for fsdp2/megatron); gradients accumulate over a step."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this (null = no clipping)."""
    collective_timeout_s: float = Field(1800.0, gt=0)
    """fsdp2/megatron: how long a collective (or a worker rank waiting for the driver's next command) may block before the run fails."""
    fsdp: FSDPConfig = FSDPConfig()
    """Settings of `backend: fsdp2`."""
    megatron: MegatronConfig = MegatronConfig()
    """Settings of `backend: megatron`."""
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    """How refit moves the new weights to generation."""

    @model_validator(mode="after")
    def _backend_options(self):
        m = self.megatron
        if m.pipeline_model_parallel_size != 1:
            _fail("trainer.megatron.pipeline_model_parallel_size", m.pipeline_model_parallel_size,
                  "1 (pipeline parallelism is not supported by the megatron backend)",
                  "set it to 1 and use tensor_model_parallel_size or more data-parallel processes instead.")
        if m.use_distributed_optimizer and m.optimizer == "torch":
            _fail("trainer.megatron.use_distributed_optimizer", True,
                  "false with trainer.megatron.optimizer 'torch' (only Megatron's optimizer shards its state)",
                  "set trainer.megatron.optimizer: megatron (GPU), or use_distributed_optimizer: false.")
        return self

    def parallel_product(self) -> tuple[int, str] | None:
        """(product of fixed parallel sizes, their description); the world size must be a multiple of it."""
        if self.backend == "fsdp2":
            return self.fsdp.data_parallel_replicate_size, "trainer.fsdp.data_parallel_replicate_size"
        if self.backend == "megatron":
            return (self.megatron.tensor_model_parallel_size * self.megatron.pipeline_model_parallel_size,
                    "trainer.megatron.tensor_model_parallel_size x pipeline_model_parallel_size")
        return None


# --------------------------------------------------------------------------- validation / logging / runtime


class CheckpointConfig(Section):
    """Step checkpoints inside an epoch, so a killed or preempted run resumes without redoing finished steps."""

    save_every_steps: int = Field(100, ge=0)
    """Write a step checkpoint every this many RL steps (0 = only at the end of each epoch / run)."""
    keep_last: int = Field(2, ge=1)
    """Step checkpoints kept (older ones are deleted once a newer one is complete)."""


class ValidationConfig(Section):
    """Held-out evaluation of the policy, pinned to one weight version each time."""

    val_at_start: bool = True
    """Validate the initial policy before the first RL step."""
    val_at_end: bool = True
    """Validate after the last RL step."""
    val_period: int = Field(0, ge=0)
    """Validate every this many RL steps (0 = only at start/end)."""
    max_val_samples: int | None = Field(None, ge=1)
    """Use at most this many held-out prompts (null = all)."""
    num_val_generations_per_prompt: int = Field(1, ge=1)
    """Samples per prompt; pass@k is reported with k = this."""
    sampling: SamplingParamsConfig = SamplingParamsConfig(greedy=True)
    """Validation-only sampling parameters (greedy by default)."""


class LoggingConfig(Section):
    """Where metrics go."""

    tensorboard: bool = True
    """Write TensorBoard event files under <run dir>/tensorboard."""
    jsonl: bool = True
    """Write one JSON object per RL step to <run dir>/metrics.jsonl."""
    progress: Literal["auto", "line", "off"] = "auto"
    """Terminal progress: `line` redraws one status line, `auto` = line on a terminal and a log line every ~5% otherwise."""


class RuntimeConfig(Section):
    """Process-level settings."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: CUDA when available, else CPU."""
    torch_num_threads: int | None = Field(None, ge=1)
    """Intra-op threads for torch on CPU (null = torch's default)."""


# --------------------------------------------------------------------------- workflow: evaluation / cluster


_SET_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class EvaluationConfig(Section):
    """The workflow's `evaluate` stage: chosen checkpoints x named prompt sets, as a submitit job array."""

    sets: dict[str, str] = {}
    """Eval sets: name -> JSON-lines prompt file (same format as data.val_file); empty = `{val: <data.val_file>}`."""
    checkpoints: list[Literal["final", "best"]] = ["final", "best"]
    """Which epoch checkpoints to evaluate: `final` (the last epoch) and/or `best` (highest validation accuracy; ties go to the later epoch)."""
    num_generations_per_prompt: int = Field(4, ge=1)
    """Samples per prompt; pass@k is reported with k = this."""
    max_samples: int | None = Field(None, ge=1)
    """Use at most this many prompts of each set (null = all)."""
    sampling: SamplingParamsConfig = SamplingParamsConfig(temperature=1.0)
    """Evaluation-only sampling parameters (temperature 1 by default, so that pass@k means something)."""

    @model_validator(mode="after")
    def _names(self):
        import re

        for name in self.sets:
            if not re.match(_SET_NAME, name):
                _fail(f"evaluation.sets.{name}", name, f"a set name matching {_SET_NAME} (it becomes a file name)",
                      "rename the set with letters, digits, '.', '_' or '-'.")
        if not self.checkpoints:
            _fail("evaluation.checkpoints", self.checkpoints, "at least one of 'final', 'best'",
                  "list the checkpoints to evaluate, e.g. [final, best].")
        return self


class SlurmJobConfig(Section):
    """Slurm resources of one submitit job (used when the workflow runs with `--profile profiles/slurm`)."""

    partition: str | None = None
    """Slurm partition (`sbatch --partition`); null = the cluster's default partition."""
    account: str | None = None
    """Slurm account to charge (`--account`); null = your default account."""
    qos: str | None = None
    """Quality of service (`--qos`); null = the default."""
    constraint: str | None = None
    """Node features required (`--constraint`, e.g. `h100`); null = any node."""
    nodes: int = Field(1, ge=1)
    """Nodes of the job."""
    tasks_per_node: int = Field(1, ge=1)
    """Processes per node (the controller job runs one; multi-process trainers set more)."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node (`--gpus-per-node`); 0 = a CPU-only job."""
    cpus_per_task: int = Field(2, ge=1)
    """CPU cores per process (`--cpus-per-task`)."""
    mem_gb: float = Field(8.0, gt=0)
    """Memory per node in GB (`--mem`)."""
    timeout_min: int = Field(60, ge=1)
    """Wall-clock limit of one attempt, in minutes (`--time`; also enforced by the local executor). A job that reaches it checkpoints and is requeued (see cluster.max_num_timeout)."""
    signal_delay_s: int = Field(90, ge=0)
    """Seconds before the time limit at which the job gets SIGUSR2, runs submitit's `checkpoint()` and requeues itself."""
    extra_sbatch: dict[str, str] = {}
    """Further sbatch options, name without dashes -> value (e.g. `{reservation: big}`), passed as submitit's `slurm_additional_parameters`."""


class ClusterConfig(Section):
    """Where the workflow's long-running stages run: the controller job (train_epoch) and the evaluation job array. The executor (local process or Slurm) is chosen by the workflow profile (`launcher` in config/config.yaml; `profiles/slurm` sets `slurm`), the resources here."""

    controller: SlurmJobConfig = SlurmJobConfig()
    """Resources of the controller job that trains one epoch (the single controller, generation and trainer in one allocation)."""
    evaluation: SlurmJobConfig = SlurmJobConfig(cpus_per_task=1, mem_gb=4.0, timeout_min=30)
    """Resources of each task of the evaluation job array (one checkpoint x one eval set)."""
    max_num_timeout: int = Field(3, ge=0)
    """How many times a job that timed out may be requeued (preemptions do not count) before the stage fails."""
    max_parallel_array_tasks: int = Field(4, ge=1)
    """Evaluation tasks running at once (`--array=...%N` on Slurm; waves of N local processes otherwise)."""
    poll_interval_s: float = Field(2.0, gt=0)
    """How often the waiting workflow rule polls its job and copies the job's log into the rule's log."""

    @model_validator(mode="after")
    def _delay(self):
        for name in ("controller", "evaluation"):
            job = getattr(self, name)
            if job.signal_delay_s >= job.timeout_min * 60:
                _fail(f"cluster.{name}.signal_delay_s", job.signal_delay_s,
                      f"fewer seconds than the time limit (cluster.{name}.timeout_min {job.timeout_min} = "
                      f"{job.timeout_min * 60} s)", "lower signal_delay_s (90 is typical) or raise timeout_min.")
        return self


# --------------------------------------------------------------------------- top level


class RecipeConfig(Section):
    """A whole rl_core run."""

    run_name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Name of the run; outputs go to <output_dir>/<run_name>/."""
    output_dir: str = "results"
    """Root directory of run outputs."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    env: EnvConfig = AdditionEnvConfig()
    generation: GenerationConfig = GenerationConfig()
    grpo: GRPOConfig = GRPOConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    loss: LossConfig = LossConfig()
    reward_shaping: RewardShapingConfig = RewardShapingConfig()
    critic: CriticConfig = CriticConfig()
    async_rl: AsyncRLConfig = AsyncRLConfig()
    trainer: TrainerConfig = TrainerConfig()
    validation: ValidationConfig = ValidationConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    """The workflow's evaluate stage (checkpoints x eval sets)."""
    cluster: ClusterConfig = ClusterConfig()
    """Slurm resources of the workflow's jobs (ignored by the local launcher except the time limits)."""

    @model_validator(mode="after")
    def _algorithms(self):
        """Cross-section rules of advantages, losses, reward shaping and the critic."""
        adv, loss, critic, op = self.advantage, self.loss, self.critic, self.reward_shaping.overlong_penalty
        if adv.kl_in_reward_coef > 0 and loss.kl_coef > 0:
            _fail("loss.kl_coef", loss.kl_coef,
                  f"0 when advantage.kl_in_reward_coef > 0 ({adv.kl_in_reward_coef}): the KL penalty goes either into the reward or into the loss, not both",
                  "set loss.kl_coef: 0 (KL in the reward) or advantage.kl_in_reward_coef: 0 (KL as a loss term).")
        if adv.estimator == "gae" and not critic.enabled:
            _fail("critic.enabled", False, "true with advantage.estimator 'gae' (GAE needs a critic's value per token)",
                  "set critic.enabled: true, or pick a critic-free estimator (grpo, gdpo, reinforce_pp, raw_reward).")
        if critic.enabled and adv.estimator != "gae":
            why = ("raw_reward uses the reward itself as the advantage, so the critic would be trained and never used; "
                   "for PPO, gae with gamma 1 and lam 1 gives reward minus the critic's value"
                   if adv.estimator == "raw_reward" else f"'{adv.estimator}' uses group or batch baselines, not values")
            _fail("critic.enabled", True, f"false with advantage.estimator '{adv.estimator}' ({why})",
                  "set advantage.estimator: gae, or critic.enabled: false.")
        if op.enabled:
            gen_max = self.generation.max_tokens
            l_max = op.max_response_tokens if op.max_response_tokens is not None else gen_max
            buf = op.buffer_tokens if op.buffer_tokens is not None else l_max // 5
            if l_max > gen_max:
                _fail("reward_shaping.overlong_penalty.max_response_tokens", l_max,
                      f"at most generation.max_tokens ({gen_max}): no completion is longer",
                      "remove it (null = generation.max_tokens) or lower it.")
            if not 1 <= buf < l_max:
                _fail("reward_shaping.overlong_penalty.buffer_tokens", op.buffer_tokens,
                      f"between 1 and L_max - 1 = {l_max - 1} (null means L_max // 5 = {l_max // 5})",
                      "set buffer_tokens explicitly, e.g. a fifth of the longest completion.")
            if adv.estimator == "gdpo" and adv.reward_weights and "overlong_penalty" not in adv.reward_weights:
                _fail("advantage.reward_weights", adv.reward_weights,
                      "an entry for `overlong_penalty` (under gdpo the length penalty is its own reward component)",
                      "add `overlong_penalty: 1.0` to advantage.reward_weights, or leave reward_weights empty.")
        if self.reward_shaping.scaling.enabled and adv.estimator == "gdpo":
            _fail("reward_shaping.scaling.enabled", True,
                  "false under advantage.estimator 'gdpo' (GDPO normalises each named component per group; scaling the total reward would change nothing)",
                  "use advantage.reward_weights to weigh components, or another estimator.")
        for path, when in _PENDING_CONTROLLER_WIRING:
            hit, value = _requested(self, path, when)
            if hit:
                _fail(path, value, "an option the controller applies (the algorithm library has it; the train pump does not apply it yet)",
                      f"remove {path} for now; it is enabled once the train pump wires it (issue 5, phase 2).")
        return self

    @model_validator(mode="after")
    def _cross(self):
        p = self.grpo.num_prompts_per_step
        a = self.async_rl
        if a.min_groups_for_streaming_train > p:
            _fail("async_rl.min_groups_for_streaming_train", a.min_groups_for_streaming_train,
                  f"at most grpo.num_prompts_per_step ({p})",
                  f"set it to {p} or less (1 streams each group into the trainer as soon as it is ready).")
        if a.reproducible and a.sampler.type != "in_order":
            _fail("async_rl.reproducible", True,
                  f"the 'in_order' sampler (got sampler type '{a.sampler.type}'): only it pins each step to one weight version",
                  "set async_rl.sampler.type: in_order, or async_rl.reproducible: false.")
        if a.reproducible and a.refit_mode is not None:
            _fail("async_rl.refit_mode", a.refit_mode,
                  "null when async_rl.reproducible is true (reproducible runs always refit behind a barrier that waits for every group pinned to the current version)",
                  "remove async_rl.refit_mode, or set async_rl.reproducible: false.")
        need = required_buffer_capacity(self)
        if a.max_buffered_groups < need:
            _fail("async_rl.max_buffered_groups", a.max_buffered_groups,
                  f">= {need} (the '{a.sampler.type}' sampler needs a whole step of groups buffered, or the pumps would deadlock)",
                  f"set async_rl.max_buffered_groups to {need} or more.")
        if self.model.source == "tiny":
            t = self.model.tiny
            if self.generation.max_tokens >= t.max_position_embeddings:
                _fail("generation.max_tokens", self.generation.max_tokens,
                      f"fewer than model.tiny.max_position_embeddings ({t.max_position_embeddings}) so a prompt still fits",
                      "lower generation.max_tokens or raise model.tiny.max_position_embeddings.")
        return self


def required_buffer_capacity(cfg: RecipeConfig) -> int:
    """Buffer slots the configured sampler needs so that dispatch can never deadlock.

    Reproducible mode holds every group of the next `lookahead` steps at a refit barrier,
    plus the step being trained."""
    p = cfg.grpo.num_prompts_per_step
    if cfg.async_rl.reproducible and cfg.async_rl.sampler.type == "in_order":
        return p * (cfg.async_rl.sampler.max_lookahead_versions + 1)
    return p
