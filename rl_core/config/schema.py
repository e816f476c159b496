"""The recipe schema: pydantic models for every knob of an rl_core run.

Owns: field names, types, defaults, per-field docs (attribute docstrings become the
field descriptions, which `rl-core docs` prints), cross-field rules that can be
checked from the recipe alone, and values derived from several fields (properties such as
`RecipeConfig.needs_reference_policy`). Validators check and never mutate; nothing here
reads the disk (an HF model's architecture is checked by the loader's preflight).

Does not own: reading YAML, command-line overrides, file-system preflight or error
formatting (see `loader.py`), and it never imports torch: loading a recipe must stay
cheap so that a bad recipe fails before any model is built.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from rl_core.config.base import (  # noqa: F401  (re-exported: the schema's public names)
    Section,
    fail,
)
from rl_core.config.model_sections import (  # noqa: F401  (re-exported: the schema's public names)
    AdditionEnvConfig,
    ChainAdditionEnvConfig,
    CustomEnvConfig,
    DataConfig,
    DataGenerateConfig,
    EnvConfig,
    EnvSection,
    ModelConfig,
    ReasoningGymEnvConfig,
    RewardFunctionSpec,
    RewardFunctionsEnvConfig,
    SuccessCriterion,
    TinyModelConfig,
    WarmupConfig,
)
from rl_core.config.generation_sections import (  # noqa: F401  (re-exported: the schema's public names)
    GenerationConfig,
    HttpBackendConfig,
    NativeEngineConfig,
    SamplingParamsConfig,
    VLLMConfig,
)
from rl_core.config.algorithm_sections import (  # noqa: F401  (re-exported: the schema's public names)
    AdvantageConfig,
    CriticConfig,
    DynamicSamplingConfig,
    GRPOConfig,
    ImportanceSamplingConfig,
    LossConfig,
    OverlongPenaltyConfig,
    RewardScalingConfig,
    RewardShapingConfig,
)
from rl_core.config.controller_sections import (  # noqa: F401  (re-exported: the schema's public names)
    AdaptiveStalenessConfig,
    AsyncRLConfig,
    CustomSamplerConfig,
    InOrderSamplerConfig,
    PartialRolloutsConfig,
    ReadyFirstSamplerConfig,
    RolloutFailureConfig,
    SamplerConfig,
    WatchdogConfig,
    WeightFifoSamplerConfig,
    WindowedSamplerConfig,
)
from rl_core.config.trainer_sections import (  # noqa: F401  (re-exported: the schema's public names)
    FSDPConfig,
    LoraConfig,
    LRScheduleConfig,
    MegatronConfig,
    RouterReplayConfig,
    TrainerConfig,
    TrainerRecoveryConfig,
    WeightSyncConfig,
    check_trainer_placement,
)
from rl_core.config.run_sections import (  # noqa: F401  (re-exported: the schema's public names)
    CheckpointConfig,
    ClusterConfig,
    EvaluationConfig,
    LoggingConfig,
    MlflowConfig,
    NodeGroupConfig,
    RuntimeConfig,
    SlurmJobConfig,
    ValidationConfig,
    WandbConfig,
)


# --------------------------------------------------------------------------- top level


class RecipeConfig(Section):
    """A whole rl_core run."""

    run_name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Name of the run; outputs go to <output_dir>/<run_name>/."""
    output_dir: str = "results"
    """Root directory of run outputs (must be a directory rl_core can create or write into; checked by `rl-core validate`)."""
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

    @property
    def needs_reference_policy(self) -> bool:
        """Whether the run keeps the frozen reference (initial) policy: exactly when a KL term to
        it is on, in the loss (`loss.kl_coef` > 0) or in the reward (`advantage.kl_in_reward_coef`
        > 0). The trainer keeps its weights and the train pump computes its logprobs then."""
        return self.loss.kl_coef > 0 or self.advantage.kl_in_reward_coef > 0

    @property
    def generated_data_dir(self) -> str | None:
        """Where `data.generate` writes the task's files (<output_dir>/<run_name>/data), or None."""
        return f"{self.output_dir}/{self.run_name}/data" if self.data.generate is not None else None

    @model_validator(mode="after")
    def _generated_data(self):
        """With `data.generate`, the data files are the generated ones (reasoning_gym only)."""
        if self.data.generate is None:
            return self
        if self.env.type != "reasoning_gym":
            fail("data.generate", self.data.generate.model_dump(), f"null with env.type {self.env.type} (rl_core "
                 "generates data from the recipe only for env.type reasoning_gym)",
                 "remove data.generate and point data.train_file / val_file at your files.")
        d = self.generated_data_dir
        for field, name in (("train_file", "train.jsonl"), ("val_file", "val.jsonl")):
            want = f"{d}/{name}"
            if field in self.data.model_fields_set and getattr(self.data, field) != want:
                fail(f"data.{field}", getattr(self.data, field), f"unset when data.generate is set (the generated "
                     f"file is {want})", f"remove data.{field}, or remove data.generate and generate the files "
                     "yourself with `rl-core make-data reasoning_gym`.")
            setattr(self.data, field, want)
        return self

    @model_validator(mode="after")
    def _trainer_placement(self):
        check_trainer_placement(self)
        return self

    @model_validator(mode="after")
    def _kl_placement(self):
        """The KL penalty to the reference goes into the reward or into the loss, not both."""
        adv, loss = self.advantage, self.loss
        if adv.kl_in_reward_coef > 0 and loss.kl_coef > 0:
            fail("loss.kl_coef", loss.kl_coef,
                  f"0 when advantage.kl_in_reward_coef > 0 ({adv.kl_in_reward_coef}): the KL penalty goes either into the reward or into the loss, not both",
                  "set loss.kl_coef: 0 (KL in the reward) or advantage.kl_in_reward_coef: 0 (KL as a loss term).")
        return self

    @model_validator(mode="after")
    def _critic_estimator(self):
        """A critic exactly when the advantage estimator uses one (gae)."""
        adv, critic = self.advantage, self.critic
        if adv.estimator == "gae" and not critic.enabled:
            fail("critic.enabled", False, "true with advantage.estimator 'gae' (GAE needs a critic's value per token)",
                  "set critic.enabled: true, or pick a critic-free estimator (grpo, gdpo, reinforce_pp, raw_reward).")
        if critic.enabled and adv.estimator != "gae":
            why = ("raw_reward uses the reward itself as the advantage, so the critic would be trained and never used; "
                   "for PPO, gae with gamma 1 and lam 1 gives reward minus the critic's value"
                   if adv.estimator == "raw_reward" else f"'{adv.estimator}' uses group or batch baselines, not values")
            fail("critic.enabled", True, f"false with advantage.estimator '{adv.estimator}' ({why})",
                  "set advantage.estimator: gae, or critic.enabled: false.")
        if critic.enabled and self.trainer.backend != "torch":
            fail("critic.enabled", True,
                 f"false with trainer.backend '{self.trainer.backend}': the critic (rl_core.train.critic) is one "
                 "whole, unsharded model trained on the controller's device, neither sharded nor data-parallel; "
                 "beside a sharded policy it would need the memory of a full model on one device, which the "
                 "distributed trainer exists to avoid (rl_core does not shard the critic)",
                 "use trainer.backend: torch for PPO with a critic, or keep the distributed trainer with a "
                 "critic-free estimator (advantage.estimator: grpo, gdpo, reinforce_pp or raw_reward) and "
                 "critic.enabled: false.")
        return self

    @model_validator(mode="after")
    def _overlong_penalty(self):
        """DAPO's overlong penalty: lengths within generation.max_tokens, and a GDPO component of its own."""
        adv, op = self.advantage, self.reward_shaping.overlong_penalty
        if op.enabled:
            gen_max = self.generation.max_tokens
            l_max = op.max_response_tokens if op.max_response_tokens is not None else gen_max
            buf = op.buffer_tokens if op.buffer_tokens is not None else l_max // 5
            if l_max > gen_max:
                fail("reward_shaping.overlong_penalty.max_response_tokens", l_max,
                      f"at most generation.max_tokens ({gen_max}): no completion is longer",
                      "remove it (null = generation.max_tokens) or lower it.")
            if not 1 <= buf < l_max:
                fail("reward_shaping.overlong_penalty.buffer_tokens", op.buffer_tokens,
                      f"between 1 and L_max - 1 = {l_max - 1} (null means L_max // 5 = {l_max // 5})",
                      "set buffer_tokens explicitly, e.g. a fifth of the longest completion.")
            if adv.estimator == "gdpo" and adv.reward_weights and "overlong_penalty" not in adv.reward_weights:
                fail("advantage.reward_weights", adv.reward_weights,
                      "an entry for `overlong_penalty` (under gdpo the length penalty is its own reward component)",
                      "add `overlong_penalty: 1.0` to advantage.reward_weights, or leave reward_weights empty.")
        return self

    @model_validator(mode="after")
    def _reward_scaling(self):
        """Scaling the total reward is meaningless under GDPO's per-component normalisation."""
        adv = self.advantage
        if self.reward_shaping.scaling.enabled and adv.estimator == "gdpo":
            fail("reward_shaping.scaling.enabled", True,
                  "false under advantage.estimator 'gdpo' (GDPO normalises each named component per group; scaling the total reward would change nothing)",
                  "use advantage.reward_weights to weigh components, or another estimator.")
        return self

    @model_validator(mode="after")
    def _generation_placement(self):
        """Where generation runs and what each backend supports (`placement_rules.check_recipe`)."""
        from rl_core.config.placement_rules import check_recipe

        check_recipe(self)
        return self

    @model_validator(mode="after")
    def _native_engine(self):
        gen = self.generation
        if gen.backend == "vllm" and gen.native != NativeEngineConfig():
            fail("generation.native", gen.native.model_dump(exclude_defaults=True),
                  "defaults with generation.backend 'vllm' (these settings are the native engine's)",
                  "remove generation.native, or use generation.backend native/http.")
        if gen.native.decode_path == "graph" and self.runtime.device == "cpu":
            fail("generation.native.decode_path", "graph", "a CUDA device for CUDA graphs (runtime.device is 'cpu')",
                  "set generation.native.decode_path: auto (graphs on CUDA, eager on CPU) or static.")
        eager = gen.native.decode_path == "eager" or (gen.native.decode_path == "auto" and self.runtime.device == "cpu")
        for knob in ("decode_compile", "overlap_steps"):
            if getattr(gen.native, knob) and eager:
                fail(f"generation.native.{knob}", True,
                      f"a static or graph decode path (decode_path is {gen.native.decode_path!r}"
                      + (" and resolves to eager on runtime.device 'cpu')" if gen.native.decode_path == "auto" else ")"),
                      f"set generation.native.decode_path: static (or graph on CUDA), or {knob}: false.")
        if gen.native.decode_attention == "fused":
            if self.runtime.device == "cpu":
                fail("generation.native.decode_attention", "fused",
                      "a CUDA runtime.device (the fused decode-attention kernel is a Triton GPU kernel; "
                      "runtime.device is 'cpu')", "set generation.native.decode_attention: torch.")
            if gen.native.decode_path == "eager":
                fail("generation.native.decode_attention", "fused",
                      "a static or graph decode path (decode_path is 'eager')",
                      "set generation.native.decode_path: auto or graph, or decode_attention: torch.")
        if gen.native.decode_mlp == "fused" and gen.native.decode_attention != "fused":
            fail("generation.native.decode_mlp", "fused",
                  "decode_attention 'fused' (the fused MLP kernel runs in the fused decode layer; it is "
                  f"{gen.native.decode_attention!r})",
                  "set generation.native.decode_attention: fused too, or decode_mlp: torch.")
        tiny = self.model.tiny if self.model.source == "tiny" else None
        if tiny is not None and gen.native.max_seq_len is not None and gen.native.max_seq_len > tiny.max_position_embeddings:
            fail("generation.native.max_seq_len", gen.native.max_seq_len,
                  f"at most model.tiny.max_position_embeddings ({tiny.max_position_embeddings})",
                  "lower generation.native.max_seq_len or leave it null (the model's context).")
        return self

    @model_validator(mode="after")
    def _router_replay(self):
        """MoE + router replay from the recipe alone (an HF model's architecture is checked by
        the loader's preflight, which reads its config.json: `check_moe_rules(cfg, hf)`)."""
        check_moe_rules(self, None)
        return self

    @model_validator(mode="after")
    def _streaming_train(self):
        """Streaming into the trainer needs no more groups than one RL step has."""
        p = self.grpo.num_prompts_per_step
        a = self.async_rl
        if a.min_groups_for_streaming_train > p:
            fail("async_rl.min_groups_for_streaming_train", a.min_groups_for_streaming_train,
                  f"at most grpo.num_prompts_per_step ({p})",
                  f"set it to {p} or less (1 streams each group into the trainer as soon as it is ready).")
        return self

    @model_validator(mode="after")
    def _reproducibility(self):
        """Reproducible runs: the in_order sampler, and refits behind the barrier."""
        a = self.async_rl
        if a.reproducible and a.sampler.type != "in_order":
            fail("async_rl.reproducible", True,
                  f"the 'in_order' sampler (got sampler type '{a.sampler.type}'): only it pins each step to one weight version",
                  "set async_rl.sampler.type: in_order, or async_rl.reproducible: false.")
        if a.reproducible and a.sampler.type == "in_order" and a.sampler.partial_rollouts.enabled:
            fail("async_rl.sampler.partial_rollouts.enabled", True,
                  "false when async_rl.reproducible is true (a reproducible step trains exactly the groups stamped "
                  "for it, generated with one weight version; a carried straggler spans versions)",
                  "turn partial_rollouts off, or set async_rl.reproducible: false.")
        if a.reproducible and a.refit_mode is not None:
            fail("async_rl.refit_mode", a.refit_mode,
                  "null when async_rl.reproducible is true (reproducible runs always refit behind a barrier that waits for every group pinned to the current version)",
                  "remove async_rl.refit_mode, or set async_rl.reproducible: false.")
        return self

    @model_validator(mode="after")
    def _sampler_dispatch(self):
        """What the sampler admits: off-policy correction for unbounded staleness, over-sampling, in-flight caps."""
        a = self.async_rl
        if a.sampler.type == "ready_first" and not self.loss.importance_sampling.enabled:
            fail("loss.importance_sampling.enabled", False,
                  "true with the 'ready_first' sampler (it trains stragglers of any age, so the generation policy can be far from the trained one)",
                  "set loss.importance_sampling.enabled: true, or use a sampler with a staleness bound (in_order, weight_fifo, windowed).")
        if a.over_sampling_ratio > 1 and a.sampler.type == "in_order":
            fail("async_rl.over_sampling_ratio", a.over_sampling_ratio,
                  "1.0 with the 'in_order' sampler (it trains every group it stamps; extra groups could never be consumed)",
                  "set async_rl.over_sampling_ratio: 1, or use the 'windowed' sampler to over-sample.")
        if a.max_inflight_generations is not None and a.max_inflight_generations < self.grpo.num_generations_per_prompt:
            fail("async_rl.max_inflight_generations", a.max_inflight_generations,
                  f">= grpo.num_generations_per_prompt ({self.grpo.num_generations_per_prompt}) so that one whole group can be in flight",
                  f"raise it to at least {self.grpo.num_generations_per_prompt}, or null to cap groups only.")
        return self

    @model_validator(mode="after")
    def _watchdog_deadlines(self):
        """The watchdog's stall timeout outlasts its interval and every rollout deadline."""
        a = self.async_rl
        f = a.failure
        w = a.watchdog
        deadlines = {name: d for name, d in (("async_rl.failure.generation_timeout_s", f.generation_timeout_s),
                                             ("async_rl.failure.env_timeout_s", f.env_timeout_s),
                                             ("env.episode_timeout_s", getattr(self.env, "episode_timeout_s", None)))
                     if d is not None}  # env.episode_timeout_s: agent and http environments
        if w.stall_timeout_s <= w.interval_s or any(w.stall_timeout_s <= d for d in deadlines.values()):
            named = ", ".join(f"{name}={d:g}" for name, d in deadlines.items()) or "none set"
            fail("async_rl.watchdog.stall_timeout_s", w.stall_timeout_s,
                  f"greater than async_rl.watchdog.interval_s ({w.interval_s}) and every rollout deadline ({named})",
                  "raise stall_timeout_s (600 is a safe default) or lower the deadlines.")
        return self

    @model_validator(mode="after")
    def _buffer_capacity(self):
        """The replay buffer holds what the sampler needs buffered (else the pumps deadlock)."""
        a = self.async_rl
        need = required_buffer_capacity(self)
        if a.max_buffered_groups < need:
            fail("async_rl.max_buffered_groups", a.max_buffered_groups,
                  f">= {need} (the '{a.sampler.type}' sampler needs a whole step of groups buffered, or the pumps would deadlock)",
                  f"set async_rl.max_buffered_groups to {need} or more.")
        return self

    @model_validator(mode="after")
    def _training_examples(self):
        """An RL step draws grpo.num_prompts_per_step distinct prompts from the examples used."""
        p = self.grpo.num_prompts_per_step
        m = self.data.max_train_examples
        if m is not None and m < p:
            fail("data.max_train_examples", m,
                  f"at least grpo.num_prompts_per_step ({p}): an RL step draws that many distinct prompts",
                  f"raise data.max_train_examples to {p} or more (null = all), or lower grpo.num_prompts_per_step.")
        return self

    @model_validator(mode="after")
    def _device_dtype(self):
        """`model.dtype` on a CPU device (CUDA/auto: checked by the launcher once the device is known)."""
        if self.runtime.device == "cpu":
            check_device_dtype(self, "cpu")
        return self

    @model_validator(mode="after")
    def _tiny_context(self):
        """A completion leaves room for the prompt in the tiny model's context."""
        if self.model.source == "tiny":
            t = self.model.tiny
            if self.generation.max_tokens >= t.max_position_embeddings:
                fail("generation.max_tokens", self.generation.max_tokens,
                      f"fewer than model.tiny.max_position_embeddings ({t.max_position_embeddings}) so a prompt still fits",
                      "lower generation.max_tokens or raise model.tiny.max_position_embeddings.")
        return self


def check_moe_rules(cfg: RecipeConfig, hf: tuple[str, bool] | None) -> None:
    """MoE + router replay: only the paths that record and replay routes (native engine, torch
    trainer). `hf` is (model_type, is a mixture of experts) of `model.path`'s config.json when
    the loader could read it (`rl_core.config.loader.check_model_architecture`), else None: the
    schema never reads the disk, and a path this machine cannot read is checked when the model loads."""
    hf = hf if cfg.model.source == "hf" else None
    moe = (cfg.model.source == "tiny" and cfg.model.tiny.architecture == "mixtral") or (hf is not None and hf[1])
    path = cfg.generation.native.decode_path
    if moe and path in ("static", "graph"):
        fail("generation.native.decode_path", path,
              "'eager' or 'auto' with an MoE policy (model.tiny.architecture 'mixtral': the static/CUDA-graph "
              "decode step has no expert dispatch and records no routes)",
              "set generation.native.decode_path: auto (eager for MoE models) or eager.")
    for knob in ("decode_compile", "overlap_steps"):
        if moe and getattr(cfg.generation.native, knob):
            fail(f"generation.native.{knob}", True,
                  f"false with an MoE policy (model.tiny.architecture 'mixtral' decodes eagerly; {knob} needs the "
                  "dense static/graph decode step)", f"set generation.native.{knob}: false.")
    if moe and cfg.generation.native.decode_attention == "fused":
        fail("generation.native.decode_attention", "fused",
              "'torch' with an MoE policy (it decodes eagerly; the fused kernel serves the dense static/graph step)",
              "set generation.native.decode_attention: torch.")
    if not cfg.trainer.router_replay.enabled:
        return
    if cfg.model.source == "tiny" and not moe:
        fail("trainer.router_replay.enabled", True,
              f"false for the dense model.tiny.architecture '{cfg.model.tiny.architecture}' (no router to replay)",
              "set model.tiny.architecture: mixtral (with num_experts, num_experts_per_tok), or disable router_replay.")
    if hf is not None and not moe:
        fail("trainer.router_replay.enabled", True,
              f"false for the dense model at model.path (config.json model_type {hf[0]!r}: no router to replay)",
              "use a mixture-of-experts policy (e.g. model_type 'mixtral'), or disable router_replay.")
    if cfg.trainer.backend != "torch":
        fail("trainer.router_replay.enabled", True,
              f"false with trainer.backend '{cfg.trainer.backend}' (only the 'torch' trainer replays routes)",
              "set trainer.backend: torch, or trainer.router_replay.enabled: false.")
    if cfg.generation.backend != "native":
        fail("trainer.router_replay.enabled", True,
              f"false with generation.backend '{cfg.generation.backend}' (only the 'native' engine records "
              "the routed experts of every token)",
              "set generation.backend: native, or trainer.router_replay.enabled: false.")


def check_device_dtype(cfg: RecipeConfig, device: str) -> None:
    """`model.dtype` must be one the device computes in: float16 is a GPU format (CPU kernels
    for it are missing or fall back to float32 arithmetic with fp16 rounding). Checked at load
    for `runtime.device: cpu` and, for `auto`, by the launcher once the device is known,
    before anything is built."""
    if device == "cpu" and cfg.model.dtype == "float16":
        fail("model.dtype", cfg.model.dtype,
              "float32 (or bfloat16) on a CPU trainer" + (" (runtime.device 'auto' found no CUDA device here)"
                                                          if cfg.runtime.device == "auto" else ""),
              "set model.dtype: float32 on the CPU, or run on a CUDA device (runtime.device: cuda).")


def required_buffer_capacity(cfg: RecipeConfig) -> int:
    """Buffer slots the configured sampler needs so that dispatch can never deadlock: the
    `in_order` sampler's rule (`InOrderSamplerConfig.required_capacity`), else one step's groups
    (a custom sampler's own `required_capacity()` is checked when the controller builds)."""
    p = cfg.grpo.num_prompts_per_step
    s = cfg.async_rl.sampler
    return s.required_capacity(p, cfg.async_rl.reproducible) if s.type == "in_order" else p
