"""Plain records passed between the parts: requests, samples, prompt groups, train chunks.

Owns: the data shapes every seam agrees on (the train pump and the checkpoint share
`TrainedGroup` and `OpenStep` through here), the column-wise record of a single-turn
group's samples (`GroupSamples`: a sequence of `Sample`s built on first access; the
controller's hot path reads its columns), `scored_sample` (the one place a scored
completion becomes a `Sample`), and the functions that pack samples into padded training
tensors (`make_train_chunk`, `make_group_chunk`). Does not own: behaviour (protocols.py) or
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

import operator
import sys
import threading
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
        if all(type(d) is dict and tuple(d) == first for d in dicts):
            self.keys: tuple | None = first
            self.values: dict | None = {k: [d[k] for d in dicts] for k in first}
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


_TOKEN_IDS, _LOGPROBS, _FINISH, _START, _END, _TOKEN_VERSIONS, _WORKER, _ROUTES = map(operator.attrgetter, (
    "token_ids", "logprobs", "finish_reason", "start_version", "end_version", "token_versions", "worker",
    "routed_experts"))
_REWARDS, _INFO = operator.attrgetter("rewards"), operator.attrgetter("info")


class GroupSamples(Sequence):
    """The N samples of one single-turn group, column-wise: what `rollout.group` builds from a
    group's generation results and scores. As a sequence it is the group's `Sample`s, built all
    at once on first access (`scored_sample`, the same records as the per-sample path) and kept;
    before that the controller's hot path (rollout pump, packing, advantages, step metrics)
    reads the columns and never builds them. Once built, the `Sample`s are the truth (code may
    modify them) and the hot path reads them instead (`columns_of`)."""

    __slots__ = ("prompt_ids", "completion_ids", "gen_logprobs", "completion_lens", "finish_reasons", "rewards",
                 "component_columns", "env_mask", "start_versions", "end_versions", "info_columns", "texts",
                 "generate_s", "env_s", "workers", "token_versions", "routed_experts", "_samples")

    def __init__(self, prompt_ids: list[int], results: list, texts: list[str], scored: list, generate_s: float,
                 env_s: list[float], mask_flagged: bool):
        """`results`: the group's `GenerationResult`s in sample order; `scored`: their `EnvResult`s."""
        self.prompt_ids = prompt_ids
        self.completion_ids = list(map(_TOKEN_IDS, results))  # attribute columns read in C (attrgetter)
        self.gen_logprobs = list(map(_LOGPROBS, results))
        self.completion_lens = list(map(len, self.completion_ids))
        self.finish_reasons = list(map(_FINISH, results))
        self.start_versions = list(map(_START, results))
        self.end_versions = list(map(_END, results))
        self.token_versions = list(map(_TOKEN_VERSIONS, results))
        self.workers = [w or "local" for w in map(_WORKER, results)]
        routes = list(map(_ROUTES, results))
        self.routed_experts = routes if routes.count(None) != len(routes) else None
        self.rewards = [float(s.reward) for s in scored]
        self.component_columns = DictColumns(list(map(_REWARDS, scored)))  # named rewards
        self.env_mask = [bool(s.mask) and mask_flagged for s in scored]
        self.info_columns = DictColumns(list(map(_INFO, scored)))  # the environment's info
        self.texts = texts
        self.generate_s = generate_s
        self.env_s = env_s
        self._samples: list[Sample] | None = None

    @property
    def components(self) -> list[dict[str, float]]:
        """The samples' named rewards, a new dict each."""
        return self.component_columns.rows()

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
    """`samples` as columns when it is a `GroupSamples` whose `Sample`s were never built, else None."""
    return samples if type(samples) is GroupSamples and not samples.built else None


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
        cols = columns_of(self.samples)
        return list(cols.rewards) if cols is not None else [s.reward for s in self.samples]


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


def make_train_chunk(samples: list[Sample], advantages: list[float] | torch.Tensor | None, pad_id: int = 0,
                     token_advantages: list[list[float]] | None = None, require_routes: bool = False) -> TrainChunk:
    """Pack samples into right-padded tensors. `advantages` has one value per sample
    (broadcast over its completion tokens) unless `token_advantages` gives per-token values;
    None: zeros, for the caller to fill in (the advantage stage). Routed experts are packed
    when any sample has them; `require_routes` (router replay) raises ValueError for a sample
    without any. Token ids and logprobs may be Python lists or 1-D NumPy arrays
    (`token_array`, `logprob_array`): arrays are concatenated in the padded layout (memory
    copies), lists converted once per field."""
    masks = [s.completion_mask for s in samples]
    return _pack([s.prompt_ids for s in samples], [s.completion_ids for s in samples],
                 [s.gen_logprobs for s in samples], None if all(m is None for m in masks) else masks,
                 [s.env_mask for s in samples], [s.start_version for s in samples], advantages, pad_id,
                 token_advantages, lambda: samples, require_routes)


def make_group_chunk(groups: Sequence[Sequence[Sample]], pad_id: int = 0, require_routes: bool = False) -> TrainChunk:
    """`make_train_chunk([s for g in groups for s in g], None, ...)`, the same tensors, reading
    the columns of groups held as `GroupSamples` instead of building their `Sample`s (other
    groups: their samples' fields). The advantages are a read-only placeholder of zeros (one
    zero expanded to [B, T], no memory): the advantage stage replaces the tensor."""
    prompts: list = []
    completions: list = []
    logprobs: list = []
    masks: list = []
    env_mask: list = []
    versions: list = []
    routes = require_routes
    for g in groups:
        cols = columns_of(g)
        if cols is not None:
            k = len(cols.rewards)
            prompts += [cols.prompt_ids] * k
            completions += cols.completion_ids
            logprobs += cols.gen_logprobs
            masks += [None] * k
            env_mask += cols.env_mask
            versions += cols.start_versions
            routes = routes or cols.routed_experts is not None
        else:
            prompts += [s.prompt_ids for s in g]
            completions += [s.completion_ids for s in g]
            logprobs += [s.gen_logprobs for s in g]
            masks += [s.completion_mask for s in g]
            env_mask += [s.env_mask for s in g]
            versions += [s.start_version for s in g]
            routes = routes or any(s.routed_experts for s in g)
    # the Samples only when some carry routes (or router replay must say which lacks them)
    return _pack(prompts, completions, logprobs, None if masks.count(None) == len(masks) else masks, env_mask,
                 versions, None, pad_id, None, (lambda: [s for g in groups for s in g]) if routes else None,
                 require_routes, placeholder=True)


def _pack(prompts: list, completions: list, logprobs: list, masks: list | None, env_mask: list, versions: list,
          advantages, pad_id: int, token_advantages, samples, require_routes: bool,
          placeholder: bool = False) -> TrainChunk:
    """make_train_chunk over columns (one entry per sample); `samples()` gives the `Sample`s
    (only asked for when a sample may carry routed experts or `require_routes` is set).
    `placeholder` (with `advantages` None): zero advantages as one expanded zero."""
    # Python lists: every field is gathered into one flat list, converted once and scattered
    # into the padded [B, T] layout with a boolean mask (row-major order of the mask =
    # concatenation order); per-sample tensor construction cost ~10x more. NumPy arrays: each
    # row is [prompt, completion, padding] and the rows are one `np.concatenate` of these
    # pieces, written into [B, T] (no mask, no row-by-row copies). The [B, T] arrays come from
    # `ARENA`: memory of earlier chunks that nothing refers to any more (no page faults).
    B = len(completions)
    plens = list(map(len, prompts))
    clens = list(map(len, completions))
    lplens = list(map(len, logprobs))
    if lplens != clens:
        i = next(i for i, (a, c) in enumerate(zip(lplens, clens)) if a != c)
        raise ValueError(f"sample {i}: {lplens[i]} generation logprobs for {clens[i]} completion tokens")
    plen = np.array(plens, dtype=np.int64)
    lengths = plen + np.array(clens, dtype=np.int64)
    T = int(lengths.max()) if B else 0
    pos = np.arange(T)
    real = np.less(pos[None, :], lengths[:, None], out=ARENA.empty((B, T), np.bool_))  # [B, T] prompt + completion
    comp = np.greater_equal(pos[None, :], plen[:, None], out=ARENA.empty((B, T), np.bool_))
    comp &= real  # [B, T] completion
    if B and {type(c) for c in completions} | {type(lp) for lp in logprobs} == {np.ndarray}:
        input_ids, gen_lp = _rows_by_concatenation(prompts, completions, logprobs, plens, clens, T, pad_id)
    else:
        input_ids = ARENA.full((B, T), pad_id, np.int64)
        gen_lp = ARENA.full((B, T), 0.0, np.float32)
        input_ids[real & ~comp] = _concat(prompts, np.int64)
        input_ids[comp] = _concat(completions, np.int64)
        gen_lp[comp] = _concat(logprobs, np.float32)
    if masks is None:
        loss_mask = ARENA.empty((B, T), np.float32)
        np.copyto(loss_mask, comp)
    else:
        mask_pieces: list = []
        for m, c in zip(masks, clens):
            if m is None:
                mask_pieces.append(np.ones(c, dtype=np.float32))
            elif len(m) != c:
                raise ValueError(f"a completion_mask of {len(m)} entries for {c} completion tokens")
            else:
                mask_pieces.append(m)
        loss_mask = ARENA.full((B, T), 0.0, np.float32)
        loss_mask[comp] = _concat(mask_pieces, np.float32)
    if token_advantages is not None:
        for i, c in enumerate(clens):
            if len(token_advantages[i]) != c:
                raise ValueError(f"sample {i}: {len(token_advantages[i])} token advantages for {c} completion tokens")
        adv = ARENA.full((B, T), 0.0, np.float32)
        adv[comp] = _concat(list(token_advantages), np.float32)
    elif advantages is None:
        adv = None if placeholder else np.zeros((B, T), dtype=np.float32)
    else:
        per = advantages.detach().cpu().to(torch.float32).reshape(-1).numpy() \
            if isinstance(advantages, torch.Tensor) else np.array([float(a) for a in advantages], dtype=np.float32)
        if per.size != B:
            raise ValueError(f"{per.size} advantages for {B} samples")
        adv = np.where(comp, per[:, None], np.float32(0.0))
    sample_mask = torch.tensor([0.0 if m else 1.0 for m in env_mask], dtype=torch.float32)
    start_versions = torch.tensor(versions, dtype=torch.long)
    attention = ARENA.empty((B, T), np.int64)
    np.copyto(attention, real)
    chunk = TrainChunk(torch.from_numpy(input_ids), torch.from_numpy(attention), torch.from_numpy(loss_mask),
                       torch.from_numpy(gen_lp),
                       torch.zeros((), dtype=torch.float32).expand(B, T) if adv is None else torch.from_numpy(adv),
                       sample_mask, start_versions)
    chunk.routed_experts = _pack_routes(samples(), T, require_routes) if samples is not None else None
    return chunk


def _rows_by_concatenation(prompts: list, completions: list, logprobs: list, plens: list[int], clens: list[int],
                           T: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and gen_logprobs [B, T] of samples whose completions and logprobs are arrays,
    each written by one concatenation of two pieces per row. Row i is [prompt_i, completion_i,
    padding_i]; the pieces are prompt_0, then per row completion_i and [padding_i,
    prompt_(i+1)] (one slice of a [pad_id x T, prompt_(i+1)] array, made once per distinct
    prompt list); logprobs likewise: zeros, then per row logprobs_i and zeros."""
    B = len(completions)
    pad = np.full(T, pad_id, dtype=np.int64)
    zero = np.zeros(2 * T, dtype=np.float32)
    joined: dict[int, dict] = {}  # id() of a prompt -> {padding: [pad x padding, prompt]} (`prompts` keeps it alive)
    zeros: dict[int, np.ndarray] = {}  # length -> zeros (views of `zero`, made once per length)
    last, cuts = None, None
    ids_pieces: list = [np.asarray(prompts[0], dtype=np.int64)]
    lp_pieces: list = [zero[:plens[0]]]
    for ids, lps, p, c, prompt, p_next in zip(completions, logprobs, plens, clens, prompts[1:], plens[1:]):
        if prompt is not last:
            cuts = joined.get(id(prompt))
            if cuts is None:
                cuts = joined[id(prompt)] = {"": np.concatenate([pad, np.asarray(prompt, dtype=np.int64)])}
            last = prompt
        tail = T - p - c
        piece = cuts.get(tail)
        if piece is None:
            piece = cuts[tail] = cuts[""][T - tail:]
        z = zeros.get(tail + p_next)
        if z is None:
            z = zeros[tail + p_next] = zero[:tail + p_next]
        ids_pieces += (ids, piece)
        lp_pieces += (lps, z)
    tail = T - plens[-1] - clens[-1]
    ids_pieces += (completions[-1], pad[:tail])
    lp_pieces += (logprobs[-1], zero[:tail])
    input_ids = ARENA.empty((B, T), np.int64)
    gen_lp = ARENA.empty((B, T), np.float32)
    np.concatenate(ids_pieces, out=input_ids.reshape(-1), casting="unsafe")
    np.concatenate(lp_pieces, out=gen_lp.reshape(-1), casting="unsafe")
    return input_ids, gen_lp


class Arena:
    """Reused memory for the [B, T] arrays of packed chunks. A chunk of 16,000 x 259 tokens
    writes ~115 MB of arrays; fresh memory for them costs a page fault per 4 KiB page on first
    touch (the kernel zeroes each page), which at 1,000 groups x 16 samples per RL step cost
    more than the copies themselves (on the development VM, up to ~4 ms per MB). A buffer is
    reused only when nothing refers to it any more: every array handed out is a view of a
    pooled buffer, and a tensor made from it (`torch.from_numpy`) keeps that view, hence the
    buffer, referenced until the last tensor or slice sharing its memory is gone. Buffers are
    sized 1/8 above the request (the step's width varies; untouched pages cost nothing). At
    most `keep` buffers and `max_bytes` are held (idle ones beyond that are dropped, least
    recently used first); buffers still in use are never dropped from under their arrays,
    only forgotten by the pool once released."""

    def __init__(self, keep: int = 16, min_bytes: int = 1 << 20, max_bytes: int = 2 << 30):
        self.keep = keep
        self.min_bytes = min_bytes  # smaller arrays come from the allocator's own free lists
        self.max_bytes = max_bytes
        self._bufs: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.fresh_bytes = 0  # allocated so far (the bytes that were not reused)

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if n < self.min_bytes:
            return np.empty(shape, dtype=dtype)
        with self._lock:
            bufs = self._bufs
            best = None
            for i in range(len(bufs)):
                if bufs[i].nbytes >= n and self._idle(i) and (best is None or bufs[i].nbytes < bufs[best].nbytes):
                    best = i
            if best is not None:
                buf = bufs.pop(best)
            else:
                buf = np.empty(n + n // 8, dtype=np.uint8)
                self.fresh_bytes += buf.nbytes
            bufs.append(buf)  # most recently used last
            i = 0
            while i < len(bufs) - 1 and (len(bufs) > self.keep or sum(b.nbytes for b in bufs) > self.max_bytes):
                if self._idle(i):
                    del bufs[i]  # the least recently used idle buffer
                else:
                    i += 1
            return buf[:n].view(dtype).reshape(shape)

    def _idle(self, i: int) -> bool:
        """Nothing but the pool refers to buffer i (the list and getrefcount's argument): no
        array or tensor made from it is alive."""
        return sys.getrefcount(self._bufs[i]) == 2

    def full(self, shape: tuple[int, ...], value, dtype) -> np.ndarray:
        out = self.empty(shape, dtype)
        out.fill(value)
        return out

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()


ARENA = Arena()


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


def _concat(pieces: list, dtype) -> np.ndarray:
    """The pieces (Python lists or 1-D arrays) end to end, as one flat array of `dtype`. Lists
    only: gathered into one list and converted once; arrays only: concatenated; mixed: each
    list converted once (a list shared by several samples, e.g. their prompt, only once)."""
    kinds = {type(p) for p in pieces}
    if np.ndarray not in kinds:
        flat: list = []
        for p in pieces:
            flat += p
        return np.array(flat, dtype=dtype) if flat else np.zeros(0, dtype=dtype)
    if len(kinds) == 1:
        return np.concatenate(pieces).astype(dtype, copy=False)
    converted: dict[int, np.ndarray] = {}  # id() of a list -> its array (the pieces keep every list alive)
    arrays = []
    for p in pieces:
        if isinstance(p, np.ndarray):
            arrays.append(p)
        else:
            a = converted.get(id(p))
            if a is None:
                a = converted[id(p)] = np.array(p, dtype=dtype)
            arrays.append(a)
    return np.concatenate(arrays).astype(dtype, copy=False)


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
