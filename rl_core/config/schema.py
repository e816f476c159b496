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
    """How rewards become per-sample advantages."""

    estimator: Literal["grpo"] = "grpo"
    """`grpo`: reward minus the group baseline, optionally divided by the group's std."""
    baseline: Literal["mean", "leave_one_out"] = "mean"
    """Group baseline: the group mean, or the mean of the other samples (leave-one-out, unbiased)."""
    normalize_std: bool = True
    """Divide by the group's reward standard deviation (+eps); groups of identical rewards get 0."""
    std_eps: float = Field(1e-6, gt=0)
    """Added to the std before dividing."""


class ImportanceSamplingConfig(Section):
    """Correction for the gap between the generation engine's and the trainer's logprobs."""

    enabled: bool = True
    """Weight each token's loss by exp(trainer_logprob - generation_logprob) (detached)."""
    level: Literal["token", "sequence"] = "token"
    """Weight per token, or one weight per sequence (exp of the summed log-ratio)."""
    truncation: Literal["none", "tis"] = "tis"
    """`tis`: clamp the weight to [min_ratio, max_ratio]; `none`: use it raw."""
    min_ratio: float = Field(0.0, ge=0.0)
    """Lower clamp of the importance weight."""
    max_ratio: float = Field(2.0, gt=0.0)
    """Upper clamp of the importance weight."""

    @model_validator(mode="after")
    def _range(self):
        if self.max_ratio <= self.min_ratio:
            _fail("loss.importance_sampling.max_ratio", self.max_ratio,
                  f"a value above loss.importance_sampling.min_ratio ({self.min_ratio})",
                  "raise max_ratio (2.0 is common) or lower min_ratio.")
        return self


class LossConfig(Section):
    """The policy loss."""

    type: Literal["clipped_pg"] = "clipped_pg"
    """`clipped_pg`: PPO-style clipped policy gradient (Schulman et al. 2017, eq. 7)."""
    clip_eps_low: float = Field(0.2, ge=0.0)
    """Lower clip of the ratio: 1 - clip_eps_low."""
    clip_eps_high: float = Field(0.2, ge=0.0)
    """Upper clip of the ratio: 1 + clip_eps_high."""
    aggregation: Literal["token", "sequence"] = "token"
    """`token`: sum over all valid tokens of the step / their count; `sequence`: per-sequence mean, then mean over sequences."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL penalty to the reference (initial) policy; 0 = off (no reference model is kept)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman, 'Approximating KL divergence', 2020)."""
    importance_sampling: ImportanceSamplingConfig = ImportanceSamplingConfig()
    """Off-policy correction between generation and trainer logprobs."""


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
    refit_mode: Literal["in_flight", "drain"] = "in_flight"
    """`in_flight`: swap weights while generations run (each sample records start and end versions); `drain`: let in-flight generations finish first, so no sample spans two versions."""


# --------------------------------------------------------------------------- trainer


class TrainerConfig(Section):
    """The training backend and its optimizer."""

    backend: Literal["torch"] = "torch"
    """`torch`: one process, plain PyTorch (CPU or one GPU)."""
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
    """Samples per forward/backward pass; gradients accumulate over a step."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this (null = no clipping)."""


# --------------------------------------------------------------------------- validation / logging / runtime


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
    async_rl: AsyncRLConfig = AsyncRLConfig()
    trainer: TrainerConfig = TrainerConfig()
    validation: ValidationConfig = ValidationConfig()
    logging: LoggingConfig = LoggingConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    @model_validator(mode="after")
    def _cross(self):
        p = self.grpo.num_prompts_per_step
        a = self.async_rl
        if a.min_groups_for_streaming_train > p:
            _fail("async_rl.min_groups_for_streaming_train", a.min_groups_for_streaming_train,
                  f"at most grpo.num_prompts_per_step ({p})",
                  f"set it to {p} or less (1 streams each group into the trainer as soon as it is ready).")
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
    """Buffer slots the configured sampler needs so that dispatch can never deadlock."""
    return cfg.grpo.num_prompts_per_step
