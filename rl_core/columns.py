"""Column-wise records of one prompt group: its generation results and its scored samples.

Owns: `GroupResults` (what a backend's group call returns: the N results of one group as
columns), `GroupScores` (what an environment's group scoring returns: the N scores as
columns), `GroupSamples` (the N scored samples of a single-turn group, column-wise; a
sequence of `Sample`s built on first access), the one column interface every consumer of a
group's samples reads (`GroupColumns`, given by `group_columns`: a `GroupSamples` as it is,
any other group's `Sample`s as the lazy view `SampleColumns`), `DictColumns` (per-sample
dicts held per key), and the token/logprob array helpers (`token_array`, `logprob_array`,
`plain`; a group's rows as views of one array: `token_rows`, `logprob_rows`, `row_views`), and
`generate_each` (a group call as a `generate` call per sample, for groups one request cannot carry).
Does not own: the per-sample records themselves (`Sample`, `GenerationResult`,
`scored_sample`: types.py), packing into training tensors (packing.py), or what a consumer
does with the columns.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import operator
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from rl_core.resilience import gather_or_cancel
from rl_core.types import REWARD_EXPECTED, GenerationResult, Sample, group_requests, is_reward, scored_sample

class GroupResults:
    """What a backend's group call (`protocols.GroupGenerationBackend.generate_group`) returns:
    the N results of one prompt group as columns, in sample order, each column what the
    `GenerationResult`s of `generate` would hold (no request record, result record or
    `SamplingParams` copy per sample). `token_ids` and `logprobs`: per sample a list or a 1-D
    NumPy array (`token_array` / `logprob_array`, or views of one array per group:
    `token_rows` / `logprob_rows`); `token_versions`: None when no sample
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



async def generate_each(generate, key: str, prompt_ids: list[int], params, seeds: list[int]) -> GroupResults:
    """A group call (`protocols.GroupGenerationBackend.generate_group`) as one `generate` call per
    sample, concurrently, started in sample order (the requests of `types.group_requests`): what a
    backend does with a group that one request cannot carry (too many samples, seeds its server
    cannot derive). As the group call promises, one failed sample fails the call and the others
    are cancelled (the backends' `generate` aborts a cancelled request), and so are all of them
    when the call is cancelled; it returns once they have ended."""
    return GroupResults.of(await gather_or_cancel(
        [asyncio.ensure_future(generate(r)) for r in group_requests(key, prompt_ids, params, seeds)]))


class GroupScores:
    """What an environment's group scoring (`protocols.GroupScoringEnvironment.score_group`)
    returns: the scores of one group's N completions as columns, in sample order, each what
    the `EnvResult`s of `score` would hold. `rewards`: N scalar rewards; `components`: reward
    name -> N values (sample i's `EnvResult.rewards` is {name: components[name][i]}, in the
    names' order); `masks`: None when no sample is masked out of the loss, else N bools;
    `infos`: info key -> N values (sample i's `EnvResult.info`, likewise). Per group that is
    a few lists instead of an `EnvResult` and two dicts per sample. Where the samples' dicts
    do not share their keys (an aborted sample's info beside scored ones), `components` or
    `infos` may instead be a list of N dicts, one per sample (`of_results`). The caller owns
    the lists handed over."""

    __slots__ = ("rewards", "components", "masks", "infos")

    def __init__(self, rewards: list[float], components: dict[str, list] | list[dict] | None = None,
                 masks: list[bool] | None = None, infos: dict[str, list] | list[dict] | None = None):
        self.rewards, self.components, self.masks = rewards, components or {}, masks
        self.infos = infos or {}

    @classmethod
    def of_results(cls, results: list) -> "GroupScores":
        """The scores of N `EnvResult`s (sample order): their dicts as given, one per sample."""
        masks = [r.mask for r in results]
        return cls([r.reward for r in results], [r.rewards for r in results], masks if any(masks) else None,
                   [r.info for r in results])

    @staticmethod
    def _lengths(cols) -> dict:
        """{column name: entries} of `components` or `infos` ({None: N} for a list of dicts)."""
        return {None: len(cols)} if type(cols) is list else {k: len(v) for k, v in cols.items()}

    def check(self, n: int, who: str) -> None:
        """ValueError unless every column has `n` entries (`who`: the call that returned them)."""
        comps, infos = self.components, self.infos
        if (len(self.rewards) == n and (self.masks is None or len(self.masks) == n)
                and _all_of_length(comps, n) and _all_of_length(infos, n)):
            self._check_values(who)
            return
        comps, infos = self._lengths(comps), self._lengths(infos)
        bad = [f"rewards ({len(self.rewards)})"] if len(self.rewards) != n else []
        if self.masks is not None and len(self.masks) != n:
            bad.append(f"masks ({len(self.masks)})")
        for what, cols in (("components", comps), ("infos", infos)):
            bad += [f"{what}{'' if k is None else f'[{k!r}]'} ({m})" for k, m in cols.items() if m != n]
        if bad:
            raise ValueError(f"{who} returned {', '.join(bad)} entries for a group of {n} completions; every "
                             f"column of a GroupScores holds one entry per completion, in sample order")

    def _check_values(self, who: str) -> None:
        """ValueError unless every reward and component is a real number within float32's range
        (`types.is_reward`, what `EnvResult` checks per sample)."""
        cols = [("rewards", self.rewards)]
        if type(self.components) is list:
            cols += [(f"components[{i}][{k!r}]", [v]) for i, d in enumerate(self.components) for k, v in d.items()]
        else:
            cols += [(f"components[{k!r}]", v) for k, v in self.components.items()]
        for name, col in cols:
            if not all(map(is_reward, col)):
                bad = next(v for v in col if not is_reward(v))
                raise ValueError(f"{who} returned {name} holding {bad!r:.80} ({type(bad).__name__}); expected "
                                 f"{REWARD_EXPECTED}. Fix: return float rewards")

    def columns(self, field: str) -> "DictColumns":
        """`components` or `infos` (`field`) as `DictColumns` of the N samples (lists taken over)."""
        cols = getattr(self, field)
        return DictColumns(cols) if type(cols) is list else DictColumns.of_columns(len(self.rewards), cols)


def _all_of_length(cols, n: int) -> bool:
    """Whether `cols` (`GroupScores.components` or `.infos`: a dict of columns or a list of
    dicts) holds `n` entries per column (`n` dicts for a list), as `GroupScores._lengths` counts them."""
    if type(cols) is list:
        return len(cols) == n
    return all(map(n.__eq__, map(len, cols.values())))


_DICTS, _VALUES = operator.attrgetter("dicts"), operator.attrgetter("values")


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

    @classmethod
    def of_columns(cls, n: int, columns: dict) -> "DictColumns":
        """The columns of `n` dicts that share the keys of `columns` (key -> n values), as given
        (no dict per sample; lists are taken over, other sequences copied into lists)."""
        self = cls.__new__(cls)
        self.n, self.keys, self.dicts = n, tuple(columns), None
        self.values = {k: v if type(v) is list else list(v) for k, v in columns.items()}
        return self

    def rows(self) -> list[dict]:
        """A new dict per sample (the same keys, order and values as the dicts given)."""
        if self.dicts is not None:
            return [d.copy() for d in self.dicts]
        if not self.keys:
            return [{} for _ in range(self.n)]
        keys = self.keys
        return [dict(zip(keys, row)) for row in zip(*self.values.values())]

    def column(self, key: str, default=None, copy: bool = True) -> list:
        """`[d.get(key, default) for d in dicts]` (`copy=False`: the list held, for a reader that
        does not modify it)."""
        if self.dicts is not None:
            return [d.get(key, default) for d in self.dicts]
        col = self.values.get(key)
        if col is None:
            return [default] * self.n
        return list(col) if copy else col

    @staticmethod
    def joined(groups: list["DictColumns"], key: str, default=None) -> list:
        """`[v for c in groups for v in c.column(key, default)]` (one group's column after another).
        Where every group holds its values per key and has `key` (the usual step), the columns
        are chained in C, without a Python loop body per group."""
        if list(map(_DICTS, groups)).count(None) == len(groups):
            cols = list(map(operator.methodcaller("get", key), map(_VALUES, groups)))
            if None not in cols:
                return list(itertools.chain.from_iterable(cols))
        out: list = []
        for c in groups:
            col = c.values.get(key) if c.dicts is None else None
            if col is not None:
                out += col
            else:
                out += c.column(key, default)
        return out

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
        (`GroupResults`, taken over as they are); `scored`: their `EnvResult`s, or their
        columns (`GroupScores`, from an environment's `score_group`)."""
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
            self.routed_experts = None if routes is None or routes.count(None) == len(routes) else routes
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
        if type(scored) is GroupScores:  # an environment's group scoring: columns already
            n = len(self.completion_ids)
            self.rewards = list(map(float, scored.rewards))
            self.component_columns = scored.columns("components")
            masks = scored.masks
            self.env_mask = list(map(bool, masks)) if mask_flagged and masks is not None else [False] * n
            self.info_columns = scored.columns("infos")
        else:
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


def _per_sample(read: Callable[[Sample], Any]) -> functools.cached_property:
    """A `SampleColumns` column: `read(sample)` for each sample, read on first use and kept."""
    return functools.cached_property(lambda self: list(map(read, self.samples)))


def _info(key: str, default: Any) -> Callable[[Sample], Any]:
    """A sample's `info[key]`, `default` when it has none."""
    return lambda s: s.info.get(key, default)


class SampleColumns(GroupColumns):
    """`GroupColumns` of a group held as `Sample` records (multi-turn, agent episodes, a
    `GroupSamples` whose records were built, shaped or restored groups): each column read from
    the records on first use. A view of the records as they are when read; the records stay
    the truth."""

    def __init__(self, samples):
        self.samples = list(samples)

    # the columns of one attribute (or info key) per sample
    prompts = _per_sample(operator.attrgetter("prompt_ids"))
    completion_ids = _per_sample(operator.attrgetter("completion_ids"))
    gen_logprobs = _per_sample(operator.attrgetter("gen_logprobs"))
    finish_reasons = _per_sample(_FINISH)
    rewards = _per_sample(_REWARD)
    env_mask = _per_sample(operator.attrgetter("env_mask"))
    start_versions = _per_sample(_START)
    end_versions = _per_sample(_END)
    env_s = _per_sample(_info("env_s", 0.0))
    generate_s_each = _per_sample(_info("generate_s", 0.0))
    turns = _per_sample(_info("turns", 1))

    @functools.cached_property
    def shared_prompt(self) -> list[int] | None:
        ps = self.prompts
        return ps[0] if ps and all(p is ps[0] for p in ps) else None

    @functools.cached_property
    def prompt_lens(self) -> list[int]:
        return list(map(len, self.prompts))

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


def token_array(ids) -> np.ndarray:
    """Token ids as the 1-D int64 array `make_train_chunk` concatenates without conversion
    (a backend that holds its tokens in an array hands them over like this)."""
    return np.asarray(ids, dtype=np.int64)


def logprob_array(values) -> np.ndarray:
    """Logprobs as the 1-D float32 array `make_train_chunk` concatenates without conversion."""
    return np.asarray(values, dtype=np.float32)


def row_views(flat: np.ndarray, lens: list[int]) -> list[np.ndarray]:
    """The rows of a 1-D array that holds them end to end (`lens`: each row's length, summing to
    `len(flat)`), as views of it: one allocation per group instead of one per row."""
    ends = list(itertools.accumulate(lens))
    if (ends[-1] if ends else 0) != len(flat):
        raise ValueError(f"row lengths summing to {ends[-1] if ends else 0} for an array of {len(flat)} values")
    return list(map(flat.__getitem__, map(slice, [0, *ends[:-1]], ends)))


def token_rows(rows: list) -> list[np.ndarray]:
    """`[token_array(r) for r in rows]` (the same values and dtype) as views of one int64 array
    (`row_views`): a group call's completions in one allocation (`GroupResults`)."""
    return _rows_in_one_array(rows, np.int64)


def logprob_rows(rows: list) -> list[np.ndarray]:
    """`[logprob_array(r) for r in rows]` (the same values and dtype) as views of one float32
    array (`row_views`): a group call's logprobs in one allocation (`GroupResults`)."""
    return _rows_in_one_array(rows, np.float32)


def _rows_in_one_array(rows: list, dtype) -> list[np.ndarray]:
    """`rows` (lists or 1-D arrays) converted to `dtype` end to end into one array, each row a view
    of it (numpy's conversion of each value, as `np.asarray(row, dtype)` converts it)."""
    lens = list(map(len, rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=sum(lens))
    return row_views(flat, lens)


def plain(values):
    """A token or logprob sequence as a Python list (JSON, checkpoints): arrays converted, lists as they are."""
    return values.tolist() if isinstance(values, np.ndarray) else values
