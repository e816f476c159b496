"""Generating and scoring one prompt group (used by the rollout pump and by validation).

Owns: per-sample seeds (a function of the run seed, epoch, example and sample index only; a
group's samples consecutive, as servers seed a request's `n` choices; `seeds_of_groups` for
many groups in one pass), recipe sampling knobs -> engine `SamplingParams`, fanning a group's
N samples out to a backend (one `generate_group` or `generate_many` call per single-turn
group where the backend has one, else a task per sample holding a generation place),
multi-turn rollouts (observation tokens masked out of the loss), deadlines, tokens per
generation worker, decoding (`rollout.decode.decode_group`) and scoring (one `score_group`
call where the environment has it). A group call's single-turn group comes back as
`columns.GroupSamples`, every other path as `Sample`s built by `types.scored_sample`.

Does not own: when groups are dispatched (rollout pump), the buffer, or retries. Read more:
docs/generation.md (group calls), docs/controller.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import operator
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from rl_core.config.schema import SamplingParamsConfig
from rl_core.rollout.decode import decode_group, decode_text
from rl_core.resilience import deadline_missed, gather_or_cancel, with_deadline
from rl_core.usercode import DaemonPool, stuck_at
from rl_core.protocols import Environment, EpisodeEnvironment, GenerationBackend
from rl_core.types import (MAX_SEED, GenerationRequest, GenerationResult, Sample, SamplingParams, group_requests,
                           scored_sample, with_seed)
from rl_core.columns import GroupResults, GroupSamples, GroupScores, plain

if TYPE_CHECKING:
    from rl_core.rollout.session_server import SessionServer

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # Steele, Lea & Flood 2014, "Fast splittable pseudorandom number generators"
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that depends only on `parts` (stable across processes and platforms)."""
    return seed_prefix(*parts) >> 1


def seed_prefix(*parts: int) -> int:
    """The hash state after `parts` (derive_seed's, before the final shift): see `seed_last`."""
    h = 0x5EED
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h


def seed_last(prefix: int, last: int) -> int:
    """Sample `last`'s seed in the group whose parts hash to `prefix` (`seed_prefix(*parts)`):
    (derive_seed(*parts) + last) mod 2^63. A group's samples have consecutive seeds, as the `n`
    choices of one request to vLLM (`seed + i`) or rl-core serve derive theirs, so a group can
    go to a server as one request with one seed and sample the same tokens."""
    return ((prefix >> 1) + int(last)) & MAX_SEED


def seeds_last(prefix: int, n: int) -> list[int]:
    """[seed_last(prefix, i) for i in range(n)] (one call per group)."""
    base = prefix >> 1
    return [(base + i) & MAX_SEED for i in range(n)]


def seeds_of_groups(parts: list[tuple[int, ...]], n: int) -> list[list[int]]:
    """[seeds_last(seed_prefix(*p), n) for p in parts] (every tuple of one length): the seeds
    of many groups in one pass of uint64 NumPy arithmetic, which wraps modulo 2^64 as the
    masked integer arithmetic of `_splitmix64` does (the same values, as Python ints). For
    the rollout pump, which draws its prompts in batches: the parts of every group hashed in
    one pass, not `seed_prefix` per group."""
    if not parts:
        return []
    flat = map(_MASK64.__and__, map(int, itertools.chain.from_iterable(parts)))  # int(p) & _MASK64, in C
    cols = np.fromiter(flat, dtype=np.uint64).reshape(len(parts), -1)
    h = np.full(len(parts), 0x5EED, dtype=np.uint64)
    for j in range(cols.shape[1]):
        h = _splitmix64_array(h ^ cols[:, j])
    return consecutive_from(h >> np.uint64(1), n)  # derive_seed(*p) + i


def consecutive_from(base: np.ndarray, n: int) -> list[list[int]]:
    """[[(b + i) mod 2^63 for i in range(n)] for b in base] (uint64 `base`, each below 2^63: the
    sums stay below 2^64)."""
    return ((base[:, None] + np.arange(n, dtype=np.uint64)) & np.uint64(MAX_SEED)).tolist()


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """`_splitmix64` of every element of a uint64 array (array arithmetic wraps modulo 2^64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sampling_params(cfg: SamplingParamsConfig, stop_token_ids: tuple[int, ...] = (),
                    extra_stop_strings: tuple[str, ...] = ()) -> SamplingParams:
    return SamplingParams(
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, greedy=cfg.greedy,
        max_tokens=cfg.max_tokens, stop_token_ids=tuple(stop_token_ids),
        stop_strings=tuple(cfg.stop) + tuple(extra_stop_strings),
    )


class GenerationSlots:
    """Generation-level backpressure: at most `limit` samples generate at once (a sample holds
    a place from its start to its end, a multi-turn sample during each of its turns).

    Also counts `queued`: samples of started groups that have not yet taken their first
    place (waiting behind the limit, or not yet scheduled). The rollout pump dispatches a
    new group only while fewer than one group's worth of samples is queued, so the places
    stay full without groups piling up behind the limit and ageing there (a group's weight
    version is its dispatch version). `on_queue_shrunk` is called when `queued` falls."""

    def __init__(self, limit: int):
        self.limit = limit
        self._sem = asyncio.Semaphore(limit)
        self.queued = 0
        self.on_queue_shrunk = None  # callable() -> None

    async def __aenter__(self):
        await self._sem.acquire()

    async def __aexit__(self, *exc):
        self._sem.release()

    def expect(self, n: int) -> "_Ticket":
        """`n` samples of one group are about to start: counted as queued until each takes a place."""
        self.queued += n
        return _Ticket(self, n)

    def shrink_queue(self, k: int) -> None:
        """`k` queued samples took a place or will never start."""
        self.queued -= k
        if self.on_queue_shrunk is not None:
            self.on_queue_shrunk()


class _Ticket:
    """The queued samples of one group; `take()` at a sample's first place, `close()` when the
    group ends (samples that never started, e.g. cancelled, stop counting)."""

    def __init__(self, slots: GenerationSlots, n: int):
        self.slots, self.remaining = slots, n

    def take(self) -> None:
        if self.remaining > 0:
            self.remaining -= 1
            self.slots.shrink_queue(1)

    def close(self) -> None:
        if self.remaining > 0:
            k, self.remaining = self.remaining, 0
            self.slots.shrink_queue(k)


@dataclass
class GroupOptions:
    """How one group is generated (shared by every group of a run)."""

    generation_timeout_s: float | None = None
    env_timeout_s: float | None = None
    gen_slots: GenerationSlots | asyncio.Semaphore | None = None  # generation-level backpressure
    mask_flagged_samples: bool = True
    sessions: SessionServer | None = None  # agent environments: the run's episode session server


@dataclass
class SampleTimings:
    generate_s: float = 0.0
    env_s: float = 0.0
    worker_tokens: dict[str, int] = field(default_factory=dict)  # generated tokens per generation worker

    def count(self, res: GenerationResult) -> GenerationResult:
        """Count `res`'s generated tokens for the worker that produced it."""
        w = res.worker or "local"
        self.worker_tokens[w] = self.worker_tokens.get(w, 0) + len(res.token_ids)
        return res


async def _generate(backend: GenerationBackend, request: GenerationRequest, opts: GroupOptions,
                    ticket: _Ticket | None = None) -> GenerationResult:
    slots = opts.gen_slots
    async with slots if slots is not None else contextlib.nullcontext():
        if ticket is not None:  # the sample's first place: no longer queued
            ticket.take()
        return await with_deadline(backend.generate(request), opts.generation_timeout_s,
                                   f"generation of {request.request_id}")


# Environment calls with a deadline run here, never in the default executor that the
# trainer's worker calls use: a hung environment must not starve training. Daemon threads: a
# call stuck past its deadline is abandoned and never keeps the process from exiting.
_ENV_POOL = DaemonPool(4, "rl_core-env")


async def _score(env, example, ids, text, finish, opts: GroupOptions, timings: SampleTimings, turns=None):
    t0 = time.monotonic()

    def call():
        return env.score_turns(example, turns) if turns is not None else env.score(example, ids, text, finish)

    try:
        if opts.env_timeout_s is None:
            return call()  # cheap environments score on the event loop
        fut = _ENV_POOL.submit(call)
        try:
            return await with_deadline(asyncio.wrap_future(fut), opts.env_timeout_s, f"environment {env.name} scoring")
        except TimeoutError:  # name where the scoring is stuck, and let a fresh thread take its place
            where = stuck_at(_ENV_POOL.thread_of(fut))
            _ENV_POOL.abandon(fut)
            raise deadline_missed(f"environment {env.name} scoring", opts.env_timeout_s, where) from None
    finally:
        timings.env_s += time.monotonic() - t0


async def generate_sample(backend: GenerationBackend, env: Environment, tokenizer, example: dict[str, Any],
                          prompt_ids: list[int], params: SamplingParams, request_id: str,
                          opts: GroupOptions, ticket: _Ticket | None = None) -> Sample:
    """One sample: a single turn, or up to `env.max_turns` turns with observations in between.
    `ticket`: its group's queued-sample count (GenerationSlots), released at its first place."""
    if env.runs_episodes:
        return await generate_episode(backend, env, tokenizer, example, params, request_id, opts, ticket)
    timings = SampleTimings()
    max_turns = int(env.max_turns)
    t0 = time.monotonic()
    if max_turns <= 1:
        res = timings.count(await _generate(backend, GenerationRequest(request_id, list(prompt_ids), params), opts,
                                            ticket))
        timings.generate_s = time.monotonic() - t0
        text = decode_text(tokenizer, res.token_ids)
        scored = await _score(env, example, res.token_ids, text, res.finish_reason, opts, timings)
        return _sample(list(res.prompt_ids), res.token_ids, res.logprobs, None, res.finish_reason,
                       res.start_version, res.end_version, res.token_versions, text, scored, opts, timings, 1,
                       routes=res.routed_experts)
    completion: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    turns = []
    starts: list[int] = []  # where each turn starts in the completion
    turn_versions: list[int] = []
    start_version = end_version = None
    finish = "stop"
    for turn in range(max_turns):
        p = replace(params, seed=None if params.seed is None else derive_seed(params.seed, turn))
        res = timings.count(await _generate(backend, GenerationRequest(f"{request_id}/t{turn}",
                                                                       list(prompt_ids) + completion, p),
                                            opts, ticket if turn == 0 else None))
        start_version = res.start_version if start_version is None else start_version
        end_version, finish = res.end_version, res.finish_reason
        starts.append(len(completion))
        turn_versions.append(res.end_version)
        completion += plain(res.token_ids)
        mask += [1] * len(res.token_ids)
        logprobs += plain(res.logprobs)
        tv = res.token_versions
        versions += plain(tv) if tv is not None and len(tv) else [res.end_version] * len(res.token_ids)
        turns.append(env.parse_completion(res.token_ids, decode_text(tokenizer, res.token_ids), res.finish_reason))
        if finish != "stop" or turn == max_turns - 1:
            break
        obs = env.observe(example, turn, turns[-1])
        if not obs:
            break
        completion += obs
        mask += [0] * len(obs)
        logprobs += [0.0] * len(obs)
        versions += [-1] * len(obs)
    timings.generate_s = time.monotonic() - t0
    text = decode_text(tokenizer, completion)
    scored = await _score(env, example, completion, text, finish, opts, timings, turns=turns)
    # MoE: the last turn re-fed the whole conversation before it, so its routes cover every token
    sample = _sample(list(prompt_ids), completion, logprobs, mask, finish, start_version, end_version, versions, text,
                     scored, opts, timings, len(turns), routes=res.routed_experts)
    sample.info.update(turn_starts=starts, turn_versions=turn_versions)
    return sample


async def generate_episode(backend: GenerationBackend, env: EpisodeEnvironment, tokenizer, example: dict[str, Any],
                           params: SamplingParams, request_id: str, opts: GroupOptions,
                           ticket: _Ticket | None = None) -> Sample:
    """One agent episode (`protocols.EpisodeEnvironment`, e.g. rl_core.envs.agent): a session is
    opened on the run's session server (`opts.sessions`) and the environment's `run_agent`
    drives it through the session's OpenAI endpoint, within `episode_timeout_s`; each model
    call is generated here like a turn (a generation place, the generation deadline, a derived
    seed) and recorded; the episode's last segment is the sample (rl_core.rollout.sessions).
    Cancelling the episode (stale abort) aborts its model calls."""
    server = opts.sessions
    if server is None:
        raise RuntimeError(f"environment {env.name} runs agent episodes, but no session server was given "
                           "(GroupOptions.sessions: the controller and the validator build one per run)")
    timings = SampleTimings()
    t0 = time.monotonic()
    first = [ticket]

    async def generate(request: GenerationRequest) -> GenerationResult:
        held, first[0] = first[0], None  # the episode's first call takes its group's queued place
        return timings.count(await _generate(backend, request, opts, held))

    def seed_for(k: int) -> int | None:
        return None if params.seed is None else derive_seed(params.seed, k)

    session = await server.open(request_id, params, tokenizer, generate, seed_for)
    attach = getattr(env, "attach_session_transport", None)  # in-process agents skip the socket
    if attach is not None:
        attach(server.transport)
    try:
        scored = await with_deadline(env.run_agent(server.base_url(session), session.api_key, example),
                                     env.episode_timeout_s, f"agent episode {request_id}")
    finally:
        await server.close(session)
        if first[0] is not None:  # the agent never called the model
            first[0].take()
    if not session.turns:  # nothing to train on: a data failure of the group, naming the agent
        agent = getattr(env, "agent_name", None) or f"the {env.name} environment's agent"
        raise ValueError(f"{agent} returned {scored.reward!r} without calling the model: an episode is trained on the "
                         "model calls it makes through its client, so it must make at least one (e.g. "
                         "`await client.chat.completions.create(model=\"policy\", messages=...)`) before it returns")
    traj = session.trajectory()
    timings.generate_s = time.monotonic() - t0
    text = decode_text(tokenizer, traj.completion_ids)
    sample = _sample(list(traj.prompt_ids), traj.completion_ids, traj.logprobs, traj.completion_mask,
                     traj.finish_reason, traj.start_version, traj.end_version, traj.token_versions, text, scored,
                     opts, timings, traj.turns)
    sample.info.update(segments=traj.segments, turn_starts=traj.turn_starts, turn_versions=traj.turn_versions)
    return sample


def _sample(prompt_ids, completion, logprobs, mask, finish, v0, v1, token_versions, text, scored,
            opts: GroupOptions, timings: SampleTimings, num_turns: int, routes=None) -> Sample:
    """A multi-turn sample or an agent episode as a `Sample` (`types.scored_sample`, which
    single-turn groups use too, through `GroupSamples`)."""
    return scored_sample(prompt_ids, completion, logprobs, mask, finish, v0, v1, token_versions, text,
                         float(scored.reward), dict(scored.rewards), bool(scored.mask) and opts.mask_flagged_samples,
                         dict(scored.info), timings.generate_s, timings.env_s, dict(timings.worker_tokens),
                         num_turns, routes)


async def generate_group(backend: GenerationBackend, env: Environment, tokenizer, example: dict[str, Any],
                         prompt_ids: list[int], n: int, params: SamplingParams, key: str,
                         seed_parts: tuple[int, ...], opts: GroupOptions | None = None,
                         seeds: list[int] | None = None) -> list[Sample] | GroupSamples:
    """N samples of one prompt, generated concurrently, each with its own derived seed.
    If one sample fails, the others are cancelled and the error propagates.

    A backend with a group call (`rl_core.protocols.GroupGenerationBackend`: `generate_group`,
    preferred, or `generate_many`) gets the group in one call when the environment is
    single-turn and no generation-level backpressure counts samples one by one (the samples
    then come as a `GroupSamples`, a sequence of the same `Sample`s); otherwise (the default)
    each sample is a task with its own `generate` call.

    `seeds`: the samples' seeds when the caller computed them already (`seeds_of_groups`),
    else derived here; sample i's seed is (derive_seed(*seed_parts) + i) mod 2^63 either way."""
    opts = opts or GroupOptions()
    if seeds is None:
        seeds = seeds_last(seed_prefix(*seed_parts), n)  # seeds[i] == seed_last(seed_prefix(*seed_parts), i)
    elif len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for a group of {n} samples")
    call = group_call(backend, env, opts)
    if call is not None:
        return await _generate_group_at_once(backend, call, env, tokenizer, example, prompt_ids, n, params, key,
                                             seeds, opts)
    slots = opts.gen_slots
    ticket = slots.expect(n) if isinstance(slots, GenerationSlots) else None
    tasks = [asyncio.ensure_future(generate_sample(backend, env, tokenizer, example, prompt_ids,
                                                   with_seed(params, seeds[i]), f"{key}/{i}",
                                                   opts, ticket)) for i in range(n)]
    try:
        return await gather_or_cancel(tasks)
    finally:
        if ticket is not None:
            ticket.close()


GROUP_CALLS = ("generate_group", "generate_many")  # the optional group calls, preferred first


def group_call_ok(backend: GenerationBackend, env: Environment, opts: GroupOptions) -> bool:
    """Whether a group goes to the backend in one call (`generate_group` or `generate_many`):
    the backend's class has one (`_own_group_call`), the environment is single-turn
    (multi-turn samples and agent episodes diverge after their first turn) and no generation
    places are counted per sample (`gen_slots`)."""
    return group_call(backend, env, opts) is not None


def group_call(backend: GenerationBackend, env: Environment, opts: GroupOptions) -> str | None:
    """The name of the group call a group goes through (see `group_call_ok`), else None."""
    if opts.gen_slots is not None or env.runs_episodes or int(env.max_turns) > 1:
        return None
    return _own_group_call(backend)


def group_scoring(env: Environment) -> bool:
    """Whether the environment scores a single-turn group in one call (`score_group`,
    `protocols.GroupScoringEnvironment`): its class defines it, in the same class as its
    `score` or a subclass of it (an override of `score` below it is never bypassed), and the
    instance does not set it to None."""
    return bool(_class_own_calls(type(env), "score", ("score_group",))) and getattr(env, "score_group", None) is not None


def _own_group_call(backend) -> str | None:
    """The first of `GROUP_CALLS` that the backend's class defines, in the same class as its
    `generate` or a subclass of it, and that the instance does not set to None. A wrapper that
    overrides `generate` and hands other attributes to an inner backend (`__getattr__`), or a
    subclass that overrides only `generate`, gets a `generate` call per sample: its
    `generate` is never bypassed."""
    for name in _class_own_calls(type(backend), "generate", GROUP_CALLS):
        if getattr(backend, name, None) is not None:
            return name
    return None


@functools.lru_cache(maxsize=64)
def _class_own_calls(cls: type, base: str, calls: tuple[str, ...]) -> tuple[str, ...]:
    """The members of `calls` that `cls` defines in the class defining `base` or a subclass of
    it (the class part of `_own_group_call` and `group_scoring`, once per class)."""
    mro = cls.__mro__
    owner = {name: next((i for i, c in enumerate(mro) if name in vars(c)), None) for name in (base,) + calls}
    if owner[base] is None:
        return ()
    return tuple(name for name in calls if owner[name] is not None and owner[name] <= owner[base])


async def _generate_group_at_once(backend: GenerationBackend, call: str, env: Environment, tokenizer,
                                  example: dict[str, Any], prompt_ids: list[int], n: int, params: SamplingParams,
                                  key: str, seeds: list[int], opts: GroupOptions) -> list[Sample] | GroupSamples:
    """The group in one group call, then each result scored in order: the same samples as the
    per-sample path (the same request ids `f"{key}/{i}"` and seeds, as a `GroupSamples`:
    columns, the `Sample`s built on first access), without a task per sample.
    `generate_group` (`call`) takes the prompt, one `SamplingParams` and the seeds and hands
    back columns (`GroupResults`); `generate_many` takes a `GenerationRequest` per sample
    (sharing one prompt list) and hands back a `GenerationResult` each (a backend that hands
    back a different prompt gets a list of `Sample`s with its prompts)."""
    prompt = list(prompt_ids)
    deadline = opts.generation_timeout_s
    what = None if deadline is None else f"generation of {key}/0..{n - 1}"
    t0 = time.monotonic()
    if call == "generate_group":
        call_group = backend.generate_group(key, prompt, params, seeds)
        results = await (call_group if deadline is None else with_deadline(call_group, deadline, what))
        if type(results) is not GroupResults:
            raise TypeError(f"{type(backend).__name__}.generate_group returned {type(results).__name__}, "
                            "expected rl_core.columns.GroupResults")
        ids, finishes = results.token_ids, results.finish_reasons
        if not (len(ids) == len(finishes) == len(results.logprobs) == n):
            raise RuntimeError(f"{type(backend).__name__}.generate_group returned {len(ids)} completions, "
                               f"{len(results.logprobs)} logprob lists and {len(finishes)} finish reasons for "
                               f"{n} samples")
    else:
        results = await with_deadline(backend.generate_many(group_requests(key, prompt, params, seeds)), deadline,
                                      what)
        if len(results) != n:
            raise RuntimeError(f"{type(backend).__name__}.generate_many returned {len(results)} results for "
                               f"{n} requests")
        ids, finishes = [r.token_ids for r in results], [r.finish_reason for r in results]
    generate_s = time.monotonic() - t0
    texts = await decode_group(tokenizer, ids)
    if opts.env_timeout_s is None and group_scoring(env):  # the environment scores the group in one call
        t1 = time.monotonic()
        scores = env.score_group(example, ids, texts, finishes)
        each = (time.monotonic() - t1) / n  # every sample's share of the call
        if type(scores) is not GroupScores:
            raise TypeError(f"{type(env).__name__}.score_group returned {type(scores).__name__}, expected "
                            "rl_core.columns.GroupScores")
        scores.check(n, f"{type(env).__name__}.score_group")
        env_s = [each] * n
    elif opts.env_timeout_s is not None:  # scored in the environment pool, concurrently
        timings = [SampleTimings() for _ in ids]
        scores = await asyncio.gather(*(_score(env, example, t, text, fin, opts, tm)
                                        for t, text, fin, tm in zip(ids, texts, finishes, timings)))
        env_s = [tm.env_s for tm in timings]
    else:  # cheap environments score on the event loop, in order: one clock read per sample
        score, clock = env.score, time.monotonic
        scores, stamps = [], [clock()]
        keep, stamp = scores.append, stamps.append
        for t, text, fin in zip(ids, texts, finishes):
            keep(score(example, t, text, fin))
            stamp(clock())  # sample i's scoring time: stamps[i + 1] - stamps[i]
        env_s = list(map(operator.sub, stamps[1:], stamps))
    group = GroupSamples(prompt, results, texts, scores, generate_s, env_s, opts.mask_flagged_samples)
    # the samples share the request's prompt list, unless the backend handed another prompt back
    if call == "generate_many" and any(r.prompt_ids is not prompt and list(r.prompt_ids) != prompt
                                       for r in results):
        samples = group.samples()
        for smp, r in zip(samples, results):
            if r.prompt_ids is not prompt:
                smp.prompt_ids = list(r.prompt_ids)
        return samples
    return group


def is_correct(sample: Sample) -> bool:
    """Whether a scored sample counts as correct (accuracy, pass@k, the best checkpoint): the
    environment's `info['correct']` where it reports one (`protocols.Environment.score`), else
    reward > 0. The step metrics' `train/accuracy` reads the same rule from a group's columns."""
    c = sample.info.get("correct")
    return bool(c) if c is not None else sample.reward > 0
