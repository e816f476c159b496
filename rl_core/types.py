"""Plain records passed between the parts: requests, samples, prompt groups, train chunks.

Owns: the data shapes every seam agrees on (the train pump and the checkpoint share
`TrainedGroup` and `OpenStep` through here), the column-wise record of a single-turn
group's samples (`GroupSamples`: a sequence of `Sample`s built on first access) and of a
group call's generation results (`GroupResults`, with `group_requests`, the per-sample
requests such a call stands for), the one
column interface every consumer of a group's samples reads (`group_columns`: a
`GroupSamples` as it is, any other group's `Sample`s as `SampleColumns`), `scored_sample` (the one place a scored
completion becomes a `Sample`), and the token/logprob array helpers. Does not own:
packing samples into padded training tensors (packing.py), behaviour (protocols.py) or
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

import functools
import operator
import time
from collections.abc import Sequence
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


class GroupResults:
    """What a backend's group call (`protocols.GroupGenerationBackend.generate_group`) returns:
    the N results of one prompt group as columns, in sample order, each column what the
    `GenerationResult`s of `generate` would hold (no request record, result record or
    `SamplingParams` copy per sample). `token_ids` and `logprobs`: per sample a list or a 1-D
    NumPy array (`token_array` / `logprob_array`); `token_versions`: None when no sample
    records them, else one entry per sample (None or the per-token versions); `workers`: None
    when `worker` produced every sample, else one name per sample; `routed_experts`: None when
    no sample has routes, else one entry per sample. The caller owns the lists handed over."""

    __slots__ = ("token_ids", "logprobs", "finish_reasons", "start_versions", "end_versions", "token_versions",
                 "workers", "worker", "routed_experts")

    def __init__(self, token_ids: list, logprobs: list, finish_reasons: list[str], start_versions: list[int],
                 end_versions: list[int], token_versions: list | None = None, workers: list[str] | None = None,
                 worker: str = "", routed_experts: list | None = None):
        self.token_ids, self.logprobs, self.finish_reasons = token_ids, logprobs, finish_reasons
        self.start_versions, self.end_versions, self.token_versions = start_versions, end_versions, token_versions
        self.workers, self.worker, self.routed_experts = workers, worker, routed_experts

    @classmethod
    def of(cls, results: list[GenerationResult]) -> "GroupResults":
        """The columns of per-sample `GenerationResult`s (a backend whose group call gathers
        per-request results)."""
        versions = list(map(_TOKEN_VERSIONS, results))
        workers = list(map(_WORKER, results))
        routes = list(map(_ROUTES, results))
        return cls(list(map(_TOKEN_IDS, results)), list(map(_LOGPROBS, results)), list(map(_FINISH, results)),
                   list(map(_START, results)), list(map(_END, results)),
                   versions if versions.count(None) != len(versions) else None,
                   workers if workers.count(workers[0] if workers else "") != len(workers) else None,
                   workers[0] if workers else "", routes if routes.count(None) != len(routes) else None)

    def __len__(self) -> int:
        return len(self.finish_reasons)


def group_requests(key: str, prompt_ids: list[int], params: SamplingParams, seeds: list[int]
                   ) -> list[GenerationRequest]:
    """The per-sample requests a group call stands for: request i is `f"{key}/{i}"` over the
    shared `prompt_ids` with `params` and seed `seeds[i]` (`dataclasses.replace(params,
    seed=...)`, without its per-call field introspection). For backends whose engine takes
    one request per sample, and for the `generate_many` fallback."""
    cls, fields, new = type(params), params.__dict__, object.__new__
    out = []
    for i, seed in enumerate(seeds):
        p = new(cls)
        p.__dict__.update(fields, seed=seed)
        out.append(GenerationRequest(f"{key}/{i}", prompt_ids, p))
    return out


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


class DictColumns:
    """One dict per sample (an environment's info or named rewards), held as one list of
    values per key when every dict has the same keys in the same order (the usual case), else
    as copies of the dicts. Per group that is a few container objects instead of one dict per
    sample: fewer new objects for the garbage collector to traverse (they triggered about one
    generation-0 collection per RL step at 1,000 groups x 16)."""

    __slots__ = ("n", "keys", "values", "dicts")

    def __init__(self, dicts: list):
        self.n = len(dicts)
        first = tuple(dicts[0]) if dicts else ()
        # every dict a dict with the same keys in the same order (maps in C: no Python loop per dict)
        if not dicts or (set(map(type, dicts)) == {dict} and set(map(tuple, dicts)) == {first}):
            self.keys: tuple | None = first
            self.values: dict | None = {k: list(map(operator.itemgetter(k), dicts)) for k in first}
            self.dicts: list | None = None
        else:
            self.keys, self.values = None, None
            self.dicts = [dict(d) for d in dicts]

    def rows(self) -> list[dict]:
        """A new dict per sample (the same keys, order and values as the dicts given)."""
        if self.dicts is not None:
            return [d.copy() for d in self.dicts]
        if not self.keys:
            return [{} for _ in range(self.n)]
        keys = self.keys
        return [dict(zip(keys, row)) for row in zip(*self.values.values())]

    def column(self, key: str, default=None) -> list:
        """`[d.get(key, default) for d in dicts]`."""
        if self.dicts is not None:
            return [d.get(key, default) for d in self.dicts]
        col = self.values.get(key)
        return list(col) if col is not None else [default] * self.n

    def has(self, key: str) -> bool:
        """Whether some dict holds `key`."""
        return key in self.values if self.dicts is None else any(key in d for d in self.dicts)

    def names(self) -> set[str]:
        """Every key of every dict."""
        return set(self.keys) if self.dicts is None else set().union(*self.dicts)


class GroupColumns:
    """The column interface of one group's samples: what the rollout pump, packing, the
    advantage stage, the step metrics and reward shaping read (`group_columns` gives it for
    any group). Per sample, in sample order: `prompts`, `prompt_lens`, `completion_ids`,
    `gen_logprobs` (lists or 1-D arrays), `completion_lens`, `completion_masks` (None when no
    sample has one, else one per sample, None for "every token"), `generated_lens` (tokens the
    policy generated: the mask's sum, else the completion's length), `finish_reasons`,
    `rewards`, `env_mask`, `start_versions`, `end_versions`, `env_s`, `generate_s_each`,
    `turns`, `routed_experts` (None when no sample has routes); per group: `shared_prompt`
    (the prompt list every sample shares, else None), `component_columns` (the named rewards)
    and `info_columns` (the samples' info dicts) as `DictColumns`, and `worker_totals()`
    (generated tokens per generation worker). Readers never modify them."""

    __slots__ = ()


_TOKEN_IDS, _LOGPROBS, _FINISH, _START, _END, _TOKEN_VERSIONS, _WORKER, _ROUTES = map(operator.attrgetter, (
    "token_ids", "logprobs", "finish_reason", "start_version", "end_version", "token_versions", "worker",
    "routed_experts"))
_REWARD, _REWARDS, _MASK, _INFO = map(operator.attrgetter, ("reward", "rewards", "mask", "info"))


class GroupSamples(Sequence, GroupColumns):
    """The N samples of one single-turn group, column-wise: what `rollout.group` builds from a
    group's generation results and scores. As a sequence it is the group's `Sample`s, built all
    at once on first access (`scored_sample`, the same records as the per-sample path) and kept;
    before that the controller's hot path (rollout pump, packing, advantages, step metrics)
    reads the columns and never builds them. Once built, the `Sample`s are the truth (code may
    modify them) and `group_columns` reads them instead (`SampleColumns`). The column members
    (`GroupColumns`) are the same in both."""

    __slots__ = ("prompt_ids", "completion_ids", "gen_logprobs", "completion_lens", "finish_reasons", "rewards",
                 "component_columns", "env_mask", "start_versions", "end_versions", "info_columns", "texts",
                 "generate_s", "env_s", "workers", "token_versions", "routed_experts", "_samples")

    def __init__(self, prompt_ids: list[int], results: list, texts: list[str], scored: list, generate_s: float,
                 env_s: list[float], mask_flagged: bool):
        """`results`: the group's `GenerationResult`s in sample order, or their columns
        (`GroupResults`, taken over as they are); `scored`: their `EnvResult`s."""
        self.prompt_ids = prompt_ids
        if type(results) is GroupResults:
            n = len(results.finish_reasons)
            self.completion_ids, self.gen_logprobs = results.token_ids, results.logprobs
            self.finish_reasons = results.finish_reasons
            self.start_versions, self.end_versions = results.start_versions, results.end_versions
            tv = results.token_versions
            self.token_versions = tv if tv is not None else [None] * n
            ws = results.workers
            self.workers = [results.worker or "local"] * n if ws is None else [w or "local" for w in ws]
            routes = results.routed_experts
            self.routed_experts = routes if routes is not None and routes.count(None) != len(routes) else None
        else:
            self.completion_ids = list(map(_TOKEN_IDS, results))  # attribute columns read in C (attrgetter)
            self.gen_logprobs = list(map(_LOGPROBS, results))
            self.finish_reasons = list(map(_FINISH, results))
            self.start_versions = list(map(_START, results))
            self.end_versions = list(map(_END, results))
            self.token_versions = list(map(_TOKEN_VERSIONS, results))
            self.workers = [w or "local" for w in map(_WORKER, results)]
            routes = list(map(_ROUTES, results))
            self.routed_experts = routes if routes.count(None) != len(routes) else None
        self.completion_lens = list(map(len, self.completion_ids))
        self.rewards = list(map(float, map(_REWARD, scored)))
        self.component_columns = DictColumns(list(map(_REWARDS, scored)))  # named rewards
        self.env_mask = list(map(bool, map(_MASK, scored))) if mask_flagged else [False] * len(scored)
        self.info_columns = DictColumns(list(map(_INFO, scored)))  # the environment's info
        self.texts = texts
        self.generate_s = generate_s
        self.env_s = env_s
        self._samples: list[Sample] | None = None

    @property
    def components(self) -> list[dict[str, float]]:
        """The samples' named rewards, a new dict each."""
        return self.component_columns.rows()

    # the rest of the column interface (`GroupColumns`): single-turn samples share one prompt,
    # have no completion mask, one turn, and the group's generation time
    @property
    def prompts(self) -> list[list[int]]:
        return [self.prompt_ids] * len(self.rewards)

    @property
    def shared_prompt(self) -> list[int]:
        return self.prompt_ids

    @property
    def prompt_lens(self) -> list[int]:
        return [len(self.prompt_ids)] * len(self.rewards)

    completion_masks = None

    @property
    def generated_lens(self) -> list[int]:
        return self.completion_lens

    @property
    def generate_s_each(self) -> list[float]:
        return [self.generate_s] * len(self.rewards)

    @property
    def turns(self) -> list[int]:
        return [1] * len(self.rewards)

    def worker_totals(self) -> dict[str, int]:
        ws, clens = self.workers, self.completion_lens
        if ws.count(ws[0]) == len(ws):  # one worker generated the whole group
            return {ws[0]: sum(clens)}
        out: dict[str, int] = {}
        for w, c in zip(ws, clens):
            out[w] = out.get(w, 0) + c
        return out

    @property
    def infos(self) -> list[dict[str, Any]]:
        """The environment's info of each sample, a new dict each."""
        return self.info_columns.rows()

    @property
    def built(self) -> bool:
        """Whether the `Sample` records exist (then they, not the columns, are the truth)."""
        return self._samples is not None

    def samples(self) -> list[Sample]:
        if self._samples is None:
            p, gen_s = self.prompt_ids, self.generate_s
            routes = self.routed_experts or [None] * len(self.rewards)
            self._samples = [
                scored_sample(p, ids, lps, None, fin, v0, v1, tv, text, r, comp, m, info, gen_s, es, {w: c}, 1, rt)
                for ids, lps, fin, v0, v1, tv, text, r, comp, m, info, es, w, c, rt in zip(
                    self.completion_ids, self.gen_logprobs, self.finish_reasons, self.start_versions,
                    self.end_versions, self.token_versions, self.texts, self.rewards, self.components,
                    self.env_mask, self.infos, self.env_s, self.workers, self.completion_lens, routes)]
        return self._samples

    def __len__(self) -> int:
        return len(self.rewards)

    def __getitem__(self, i):
        return self.samples()[i]

    def __iter__(self):
        return iter(self.samples())

    def __eq__(self, other):
        if isinstance(other, (list, GroupSamples)):
            return self.samples() == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:  # never builds the Samples (asyncio and loggers repr results)
        if self._samples is not None:
            return f"GroupSamples({self._samples!r})"
        return (f"GroupSamples(<{len(self)} samples, columns>, prompt_ids={self.prompt_ids!r}, "
                f"rewards={self.rewards!r}, completion_lens={self.completion_lens!r}, "
                f"finish_reasons={self.finish_reasons!r})")


def columns_of(samples) -> GroupSamples | None:
    """`samples` itself when it is a `GroupSamples` whose `Sample`s were never built, else None
    (whether a group is still held as columns alone; consumers read `group_columns`)."""
    return samples if type(samples) is GroupSamples and not samples.built else None


class SampleColumns(GroupColumns):
    """`GroupColumns` of a group held as `Sample` records (multi-turn, agent episodes, a
    `GroupSamples` whose records were built, shaped or restored groups): each column read from
    the records on first use. A view of the records as they are when read; the records stay
    the truth."""

    def __init__(self, samples):
        self.samples = list(samples)

    @functools.cached_property
    def prompts(self) -> list:
        return [s.prompt_ids for s in self.samples]

    @functools.cached_property
    def shared_prompt(self) -> list[int] | None:
        ps = self.prompts
        return ps[0] if ps and all(p is ps[0] for p in ps) else None

    @functools.cached_property
    def prompt_lens(self) -> list[int]:
        return list(map(len, self.prompts))

    @functools.cached_property
    def completion_ids(self) -> list:
        return [s.completion_ids for s in self.samples]

    @functools.cached_property
    def gen_logprobs(self) -> list:
        return [s.gen_logprobs for s in self.samples]

    @functools.cached_property
    def completion_lens(self) -> list[int]:
        return list(map(len, self.completion_ids))

    @functools.cached_property
    def completion_masks(self) -> list | None:
        masks = [s.completion_mask for s in self.samples]
        return None if masks.count(None) == len(masks) else masks

    @functools.cached_property
    def generated_lens(self) -> list[int]:
        masks = self.completion_masks
        if masks is None:
            return self.completion_lens
        return [c if m is None else sum(m) for m, c in zip(masks, self.completion_lens)]

    @functools.cached_property
    def finish_reasons(self) -> list[str]:
        return [s.finish_reason for s in self.samples]

    @functools.cached_property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @functools.cached_property
    def env_mask(self) -> list[bool]:
        return [s.env_mask for s in self.samples]

    @functools.cached_property
    def start_versions(self) -> list[int]:
        return [s.start_version for s in self.samples]

    @functools.cached_property
    def end_versions(self) -> list[int]:
        return [s.end_version for s in self.samples]

    @functools.cached_property
    def env_s(self) -> list[float]:
        return [s.info.get("env_s", 0.0) for s in self.samples]

    @functools.cached_property
    def generate_s_each(self) -> list[float]:
        return [s.info.get("generate_s", 0.0) for s in self.samples]

    @functools.cached_property
    def turns(self) -> list[int]:
        return [s.info.get("turns", 1) for s in self.samples]

    @functools.cached_property
    def routed_experts(self) -> list | None:
        routes = [s.routed_experts for s in self.samples]
        return routes if any(routes) else None

    @functools.cached_property
    def component_columns(self) -> DictColumns:
        return DictColumns([s.rewards for s in self.samples])

    @functools.cached_property
    def info_columns(self) -> DictColumns:
        return DictColumns([s.info for s in self.samples])

    def worker_totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.samples:
            for w, c in s.info.get("worker_tokens", {}).items():
                out[w] = out.get(w, 0) + c
        return out


def group_columns(samples) -> GroupColumns:
    """The column interface (`GroupColumns`) of one group's samples: a `GroupSamples` whose
    `Sample`s were never built as it is (no conversion), a columns object as it is, any other
    sequence of `Sample`s as `SampleColumns` (the one conversion, where a consumer receives
    the group)."""
    if type(samples) is GroupSamples:
        return SampleColumns(samples) if samples.built else samples
    if isinstance(samples, SampleColumns):
        return samples
    return SampleColumns(samples)


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
        return list(group_columns(self.samples).rewards)


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
        for k in ("input_ids", "attention_mask", "loss_mask", "gen_logprobs", "advantages", "ref_logprobs",
                  "prev_logprobs", "values", "returns", "routed_experts"):
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


def token_array(ids) -> np.ndarray:
    """Token ids as the 1-D int64 array `make_train_chunk` concatenates without conversion
    (a backend that holds its tokens in an array hands them over like this)."""
    return np.asarray(ids, dtype=np.int64)


def logprob_array(values) -> np.ndarray:
    """Logprobs as the 1-D float32 array `make_train_chunk` concatenates without conversion."""
    return np.asarray(values, dtype=np.float32)


def plain(values):
    """A token or logprob sequence as a Python list (JSON, checkpoints): arrays converted, lists as they are."""
    return values.tolist() if isinstance(values, np.ndarray) else values
