"""Plain records passed between the parts: requests, samples, prompt groups, train chunks.

Owns: the data shapes every seam agrees on (a weight sync's `SyncReport` too),
`group_requests` (the per-sample requests a group call stands for), and `scored_sample` (the
one place a scored completion becomes a `Sample`); imports nothing of rl_core. Token
alignment: a sequence is `prompt_ids + completion_ids`, per-token arrays of a chunk align
with `input_ids` (position t describes token t); routed experts are `num_layers * k` ids per
token, layer-major, -1 where missing.

Does not own: the column-wise records of a group (`GroupResults`, `GroupSamples`, the
`GroupColumns` interface: columns.py), packing samples into padded training tensors
(packing.py), behaviour (protocols.py) or any policy about what to train.

Read more: docs/architecture.md (vocabulary, data flow), docs/moe.md (routes).
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SamplingParams:
    """Per-request sampling. `greedy` (or temperature 0) takes the arg-max token."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0  # also report the this-many most likely tokens at each position (0 = off)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """Temperature under which logprobs are reported: log_softmax(logits / T) (T=1 when greedy)."""
        return 1.0 if self.is_greedy else self.temperature


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class GenerationResult:
    """What a backend returns for one request."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    start_version: int
    end_version: int
    token_versions: list[int] | None = None  # weight version that produced each token
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob) of the most likely, when asked
    started_at: float = 0.0
    finished_at: float = 0.0
    routed_experts: list[list[int]] | None = None  # MoE: per token of prompt + completion, layers x k expert ids
    worker: str = ""  # which generation worker produced it: an HTTP/vLLM server's URL, "native", "vllm"


MAX_SEED = 2**63 - 1  # sampling seeds are 0 .. 2^63 - 1: a group's seeds wrap mod 2^63 (rollout.group.seed_last)


def group_requests(key: str, prompt_ids: list[int], params: SamplingParams, seeds: list[int]
                   ) -> list[GenerationRequest]:
    """The per-sample requests a group call stands for: request i is `f"{key}/{i}"` over the
    shared `prompt_ids` with `with_seed(params, seeds[i])`. For backends whose engine takes
    one request per sample, and for the `generate_many` fallback."""
    return [GenerationRequest(f"{key}/{i}", prompt_ids, with_seed(params, seed)) for i, seed in enumerate(seeds)]


def with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    """`dataclasses.replace(params, seed=seed)` without its per-call field introspection
    (`copy.copy` costs as much, through the reduce protocol)."""
    out = object.__new__(type(params))
    out.__dict__.update(params.__dict__, seed=seed)
    return out


@dataclass
class EnvResult:
    """What an environment says about one completion. `info["correct"]` (a bool), where given,
    is whether the sample counts as correct (accuracy, pass@k); else reward > 0 counts. The
    reward and each component must be real numbers within float32's range (`is_reward`): a
    string, a list or 1e300 is a `ValueError` naming the field, never coerced or zeroed later."""

    reward: float
    rewards: dict[str, float] = field(default_factory=dict)  # named components (multi-reward)
    mask: bool = False  # True: exclude this sample from the loss (environment-flagged)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not is_reward(self.reward):
            raise ValueError(f"EnvResult.reward got {self.reward!r:.80} ({type(self.reward).__name__}); expected "
                             f"{REWARD_EXPECTED}. Fix: return a float, e.g. EnvResult(reward=1.0).")
        if not isinstance(self.rewards, dict):
            raise ValueError(f"EnvResult.rewards got {type(self.rewards).__name__}; expected a dict of named float "
                             "components. Fix: e.g. EnvResult(reward=1.0, rewards={'correct': 1.0}).")
        for name, value in self.rewards.items():
            if type(name) is not str or not is_reward(value):
                raise ValueError(f"EnvResult.rewards[{name!r:.40}] got {value!r:.80} ({type(value).__name__}); "
                                 f"expected a string name and {REWARD_EXPECTED}. Fix: return floats, e.g. "
                                 "rewards={'correct': 1.0}.")


REWARD_LIMIT = 3.4028234663852886e38
"""Largest reward magnitude: float32's largest finite value (rewards and advantages are
float32 tensors in training; 1e300 is finite in float64 but infinite there)."""
REWARD_EXPECTED = "a real number (int or float) with |reward| <= 3.4e38 (float32's range: rewards train in float32)"


def is_reward(value: Any) -> bool:
    """Whether `value` is a usable reward: a real number (bools count as 0/1; a string, None or a
    tensor does not) whose magnitude fits float32 (NaN and infinities do not)."""
    if type(value) is float or type(value) is int or isinstance(value, numbers.Real):
        try:
            return abs(float(value)) <= REWARD_LIMIT
        except (OverflowError, TypeError, ValueError):  # an int too large for a float
            return False
    return False


@dataclass
class Sample:
    """One scored completion of a prompt."""

    prompt_ids: list[int]
    completion_ids: list[int]
    gen_logprobs: list[float]
    reward: float
    finish_reason: str
    start_version: int
    end_version: int
    rewards: dict[str, float] = field(default_factory=dict)
    env_mask: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    # multi-turn: 1 for tokens the policy generated, 0 for environment observations inside the completion
    completion_mask: list[int] | None = None
    # MoE: per token of prompt + completion, the generation's layers x k expert ids (see the module docstring)
    routed_experts: list[list[int]] | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def scored_sample(prompt_ids, completion, logprobs, mask, finish: str, v0: int, v1: int, token_versions,
                  text: str, reward: float, rewards: dict[str, float], env_mask: bool, info: dict[str, Any],
                  generate_s: float, env_s: float, worker_tokens: dict[str, int], num_turns: int,
                  routes=None) -> Sample:
    """A scored completion as a `Sample` (the one place where they are built). `info`: a copy of
    the environment's info that the sample owns; text, timings, turns, the generated tokens per
    worker and the per-token weight versions are added to it, in that order."""
    info.update(text=text, generate_s=generate_s, env_s=env_s, turns=num_turns, worker_tokens=worker_tokens)
    if token_versions is not None:
        info["token_versions"] = token_versions
    return Sample(prompt_ids, completion, logprobs, reward, finish, v0, v1, rewards, env_mask, info, mask, routes)


@dataclass
class PromptGroup:
    """All N samples of one prompt: the unit of dispatch, buffering, sampling and eviction."""

    group_id: str
    prompt_index: int  # index of the example in the training file
    epoch: int
    example: dict[str, Any]
    samples: list[Sample]  # or a GroupSamples (the same records, column-wise)
    start_version: int  # weight version served when the group was dispatched
    end_version: int  # weight version served when its last sample finished
    target_step: int | None = None
    dispatched_at: float = 0.0
    committed_at: float = field(default_factory=time.monotonic)
    metrics: dict[str, Any] = field(default_factory=dict)  # (sum, count) pairs, e.g. reward shaping

    @property
    def rewards(self) -> list[float]:
        """Each sample's reward, as `rl_core.columns.group_columns(samples).rewards` reads it: a
        GroupSamples whose `Sample`s were never built (`built` false) from its column, without
        building them; `Sample` records from the records."""
        if getattr(self.samples, "built", True):
            return [s.reward for s in self.samples]
        return list(self.samples.rewards)


@dataclass
class TrainChunk:
    """Padded tensors for a set of samples (right padding), aligned with input_ids."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long, 1 = real token
    loss_mask: torch.Tensor  # [B, T] float, 1 = completion token that is trained
    gen_logprobs: torch.Tensor  # [B, T] float, generation logprob of token t (0 where masked)
    advantages: torch.Tensor  # [B, T] float (sequence advantages broadcast over tokens)
    sample_mask: torch.Tensor  # [B] float, 0 = sample excluded from the loss
    start_versions: torch.Tensor  # [B] long
    ref_logprobs: torch.Tensor | None = None  # [B, T] float, reference policy (for KL)
    prev_logprobs: torch.Tensor | None = None  # [B, T] float, policy before this RL step's updates
    values: torch.Tensor | None = None  # [B, T] float, critic's V(s_t) when advantages were computed (PPO)
    returns: torch.Tensor | None = None  # [B, T] float, the critic's targets (PPO)
    routed_experts: torch.Tensor | None = None  # [B, T, layers * k] long, generation's expert ids (-1 = missing)

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])

    def num_valid_tokens(self) -> int:
        return int((self.loss_mask * self.sample_mask[:, None]).sum().item())

    def to(self, device: torch.device | str) -> "TrainChunk":
        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        return TrainChunk(**{k: move(getattr(self, k)) for k in self.__dataclass_fields__})

    def take(self, idx: torch.Tensor) -> "TrainChunk":
        """The rows `idx` (a LongTensor, on any device), right padding trimmed."""
        def pick(t):
            return None if t is None else t.index_select(0, idx.to(t.device))

        out = TrainChunk(**{k: pick(getattr(self, k)) for k in self.__dataclass_fields__})
        return out.slice(0, out.num_samples)

    @staticmethod
    def concat(chunks: list["TrainChunk"], pad_id: int = 0) -> "TrainChunk":
        """Rows of several chunks in order, right-padded to the widest (a field is kept only if
        every chunk has it)."""
        if len(chunks) == 1:
            return chunks[0]
        width = max(c.input_ids.shape[1] for c in chunks)
        fills = {"input_ids": pad_id}

        def cat(name):
            ts = [getattr(c, name) for c in chunks]
            if any(t is None for t in ts):
                return None
            if ts[0].dim() == 1:
                return torch.cat(ts)
            if ts[0].dim() == 3:  # routed experts: pad the token dimension with -1 (missing)
                return torch.cat([torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[1]), value=-1)
                                  for t in ts])
            return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fills.get(name, 0))
                              for t in ts])

        return TrainChunk(**{k: cat(k) for k in TrainChunk.__dataclass_fields__})

    def slice(self, start: int, stop: int) -> "TrainChunk":
        def cut(t):
            return None if t is None else t[start:stop]

        out = TrainChunk(**{k: cut(getattr(self, k)) for k in self.__dataclass_fields__})
        # trim right padding shared by the slice
        width = int(out.attention_mask.sum(dim=1).max().item()) if out.num_samples else 0
        for k in ("input_ids", "attention_mask", "loss_mask", "gen_logprobs", "advantages", "ref_logprobs",
                  "prev_logprobs", "values", "returns", "routed_experts"):
            t = getattr(out, k)
            if t is not None:
                setattr(out, k, t[:, :width])
        return out


@dataclass
class SyncReport:
    """What one weight sync moved and how long it took (`rl_core.protocols.WeightSync.push`)."""

    kind: str
    version: int
    bytes: int
    seconds: float
    parts: dict[str, float] = field(default_factory=dict)  # e.g. write_s, load_s, send_s

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def as_metrics(self) -> dict[str, float]:
        out = {"bytes": float(self.bytes), "update_s": self.seconds, "bytes_per_s": self.bytes_per_s}
        out.update(self.parts)
        return out
