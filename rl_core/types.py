"""Plain records passed between the parts: requests, samples, prompt groups, train chunks.

Owns: the data shapes every seam agrees on (the train pump and the checkpoint share
`TrainedGroup` and `OpenStep` through here), and the one function that packs samples into
padded training tensors (`make_train_chunk`). Does not own: behaviour (protocols.py) or
any policy about what to train (samplers, algorithms).

Token alignment used everywhere: a sequence is `prompt_ids + completion_ids`; per-token
arrays of a chunk are aligned with `input_ids`, the value at position t describing token t
(its logprob given tokens < t). Prompt positions and padding carry `loss_mask = 0`.

Routed experts (mixture-of-experts policies): per token of `prompt_ids + completion_ids`,
a flat list of `num_layers * k` expert ids, layer-major (entry `l * k + j` is the j-th
expert of layer l); an empty list (or a list shorter than the sequence) means the token's
routes were not recorded. In a chunk they become `routed_experts` [B, T, layers * k] (the
same layer-major order) with -1 where missing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from rl_core.buffer.replay_buffer import Slot


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


@dataclass
class EnvResult:
    """What an environment says about one completion."""

    reward: float
    rewards: dict[str, float] = field(default_factory=dict)  # named components (multi-reward)
    mask: bool = False  # True: exclude this sample from the loss (environment-flagged)
    info: dict[str, Any] = field(default_factory=dict)


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


@dataclass
class PromptGroup:
    """All N samples of one prompt: the unit of dispatch, buffering, sampling and eviction."""

    group_id: str
    prompt_index: int  # index of the example in the training file
    epoch: int
    example: dict[str, Any]
    samples: list[Sample]
    start_version: int  # weight version served when the group was dispatched
    end_version: int  # weight version served when its last sample finished
    target_step: int | None = None
    dispatched_at: float = 0.0
    committed_at: float = field(default_factory=time.monotonic)
    metrics: dict[str, Any] = field(default_factory=dict)  # (sum, count) pairs, e.g. reward shaping

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


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
        """The rows `idx` (a LongTensor), right padding trimmed."""
        def pick(t):
            return None if t is None else t.index_select(0, idx)

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
        for k in ("input_ids", "attention_mask", "loss_mask", "gen_logprobs", "advantages", "ref_logprobs", "prev_logprobs",
                  "values", "returns", "routed_experts"):
            t = getattr(out, k)
            if t is not None:
                setattr(out, k, t[:, :width])
        return out


@dataclass
class TrainedGroup:
    """A prompt group the train pump took for an RL step, with its advantages."""

    slot: Slot  # its buffer slot (rl_core.buffer.replay_buffer.Slot)
    group: PromptGroup
    advantages: list[float]
    staleness: int  # trainer version at train time - weight version at dispatch


@dataclass
class OpenStep:
    """An RL step interrupted between two of its PPO mini-steps: what the train pump needs to
    continue it at `next_ministep` (after a checkpoint between mini-steps, or a failure once
    some mini-steps had updated the policy). Built by the train pump, written and read back by
    rl_core.checkpoint.run_state, handed back to the train pump on resume."""

    step: int  # the RL step
    next_ministep: int  # index of the first mini-step not yet done (epoch * num_minibatches + j)
    trained: list[TrainedGroup]  # the step's groups, in training order
    chunk: TrainChunk  # the step's whole batch (previous-policy logprobs included when computed)
    served_weights: dict[str, torch.Tensor] | None = None  # the step's starting weights (generation serves them)
    metric_sums: dict[str, float] = field(default_factory=dict)  # the finished mini-steps' metric sums
    metric_counts: dict[str, int] = field(default_factory=dict)  # and how many mini-steps reported each


def make_train_chunk(samples: list[Sample], advantages: list[float] | torch.Tensor, pad_id: int = 0,
                     token_advantages: list[list[float]] | None = None, require_routes: bool = False) -> TrainChunk:
    """Pack samples into right-padded tensors. `advantages` has one value per sample
    (broadcast over its completion tokens) unless `token_advantages` gives per-token values.
    Routed experts are packed when any sample has them; `require_routes` (router replay)
    raises ValueError for a sample without any."""
    # One pass over the samples gathers every token into flat lists; each field is then
    # converted once and scattered into the padded [B, T] layout with a boolean mask (row-major
    # order of the mask = concatenation order). Per-sample tensor construction cost ~10x more.
    B = len(samples)
    plens = [len(s.prompt_ids) for s in samples]
    clens = [len(s.completion_ids) for s in samples]
    lengths = [p + c for p, c in zip(plens, clens)]
    T = max(lengths) if samples else 0
    flat_ids: list[int] = []
    flat_lp: list[float] = []
    for i, s in enumerate(samples):
        if len(s.gen_logprobs) != clens[i]:
            raise ValueError(f"sample {i}: {len(s.gen_logprobs)} generation logprobs for {clens[i]} completion tokens")
        flat_ids += s.prompt_ids
        flat_ids += s.completion_ids
        flat_lp += s.gen_logprobs
    pos = torch.arange(T)
    real = pos[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]  # [B, T] prompt + completion
    comp = real & (pos[None, :] >= torch.tensor(plens, dtype=torch.long)[:, None])  # [B, T] completion
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    input_ids[real] = _long_tensor(flat_ids)
    attention = real.long()
    if all(s.completion_mask is None for s in samples):
        loss_mask = comp.float()
    else:
        flat_mask: list[float] = []
        for s, c in zip(samples, clens):
            if s.completion_mask is None:
                flat_mask += [1.0] * c
            elif len(s.completion_mask) != c:
                raise ValueError(f"a completion_mask of {len(s.completion_mask)} entries for {c} completion tokens")
            else:
                flat_mask += s.completion_mask
        loss_mask = torch.zeros((B, T), dtype=torch.float32)
        loss_mask[comp] = _float_tensor(flat_mask)
    gen_lp = torch.zeros((B, T), dtype=torch.float32)
    gen_lp[comp] = _float_tensor(flat_lp)
    if token_advantages is not None:
        flat_adv: list[float] = []
        for i, c in enumerate(clens):
            if len(token_advantages[i]) != c:
                raise ValueError(f"sample {i}: {len(token_advantages[i])} token advantages for {c} completion tokens")
            flat_adv += token_advantages[i]
        adv = torch.zeros((B, T), dtype=torch.float32)
        adv[comp] = _float_tensor(flat_adv)
    else:
        per = advantages.detach().cpu().to(torch.float32).reshape(-1) if isinstance(advantages, torch.Tensor) \
            else torch.tensor([float(a) for a in advantages], dtype=torch.float32)
        if per.numel() != B:
            raise ValueError(f"{per.numel()} advantages for {B} samples")
        adv = torch.where(comp, per[:, None], torch.zeros((), dtype=torch.float32))
    sample_mask = torch.tensor([0.0 if s.env_mask else 1.0 for s in samples], dtype=torch.float32)
    versions = torch.tensor([s.start_version for s in samples], dtype=torch.long)
    chunk = TrainChunk(input_ids, attention, loss_mask, gen_lp, adv, sample_mask, versions)
    chunk.routed_experts = _pack_routes(samples, T, require_routes)
    return chunk


def _long_tensor(values: list[int]) -> torch.Tensor:
    """A flat int64 tensor from a list (through the buffer protocol: far cheaper than torch.tensor)."""
    return torch.from_numpy(np.array(values, dtype=np.int64)) if values else torch.zeros(0, dtype=torch.long)


def _float_tensor(values: list[float]) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.float32)) if values else torch.zeros(0, dtype=torch.float32)


def _pack_routes(samples: list[Sample], width: int, required: bool) -> torch.Tensor | None:
    """[B, T, layers * k] expert ids (-1 where not recorded), or None when no sample has routes."""
    if required:
        for i, s in enumerate(samples):
            if not s.routed_experts or not any(s.routed_experts):
                raise ValueError(
                    f"router replay is on (trainer.router_replay.enabled) but sample {i} of this batch "
                    f"(prompt {s.prompt_ids[:8]}{'...' if len(s.prompt_ids) > 8 else ''}, {len(s.completion_ids)} "
                    f"completion tokens, weight versions {s.start_version}..{s.end_version}) carries no routed "
                    "experts: "
                    "its generation backend did not record them (only generation.backend 'native' records routes, "
                    "for mixture-of-experts models). Generate with the native engine, or set "
                    "trainer.router_replay.enabled: false.")
    per_token = next((r for s in samples for r in (s.routed_experts or ()) if r), None)
    if per_token is None:
        return None
    n = len(per_token)
    out = torch.full((len(samples), width, n), -1, dtype=torch.long)
    missing = [-1] * n
    for i, s in enumerate(samples):
        rows = [r if r else missing for r in (s.routed_experts or [])[:width]]
        bad = next((t for t, r in enumerate(rows) if len(r) != n), None)
        if bad is not None:
            raise ValueError(f"sample {i}, token {bad}: {len(rows[bad])} routed expert ids; other tokens have {n} "
                             "(layers x k). Routes of one batch must come from one model.")
        if rows:
            out[i, :len(rows)] = torch.tensor(rows, dtype=torch.long)
    return out
