"""The controller's fast paths (issue 18, item 3) give the same results as the plain ones:
`make_train_chunk` packs exactly what a per-sample reference packing gives; the replay
buffer's per-state indexes agree with a scan of its slots through every transition; the
group's per-sample seeds equal `derive_seed`."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from rl_core.buffer.replay_buffer import ReplayBuffer, SlotState
from rl_core.rollout.group import seed_last, seed_prefix, with_seed, derive_seed
from rl_core.packing import make_train_chunk
from rl_core.types import PromptGroup, Sample, SamplingParams


def _reference_chunk(samples, advantages, pad_id, token_advantages=None):
    """The per-sample packing make_train_chunk replaced (one row at a time)."""
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    B, T = len(samples), max(lengths) if samples else 0
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    att = torch.zeros((B, T), dtype=torch.long)
    lm = torch.zeros((B, T))
    lp = torch.zeros((B, T))
    adv = torch.zeros((B, T))
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[i, :p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        att[i, :p + c] = 1
        lm[i, p:p + c] = 1.0 if s.completion_mask is None else torch.tensor(s.completion_mask, dtype=torch.float32)
        lp[i, p:p + c] = torch.tensor(s.gen_logprobs, dtype=torch.float32)
        adv[i, p:p + c] = torch.tensor(token_advantages[i]) if token_advantages is not None else float(advantages[i])
    return ids, att, lm, lp, adv


def _samples(rng: random.Random, n: int, masks: bool) -> list[Sample]:
    out = []
    for _ in range(n):
        p, c = rng.randrange(1, 7), rng.randrange(0, 12)
        out.append(Sample(prompt_ids=[rng.randrange(1, 99) for _ in range(p)],
                          completion_ids=[rng.randrange(1, 99) for _ in range(c)],
                          gen_logprobs=[-rng.random() * 3 for _ in range(c)], reward=rng.random(),
                          finish_reason="stop", start_version=rng.randrange(4), end_version=4,
                          env_mask=rng.random() < 0.2,
                          completion_mask=[rng.randrange(2) for _ in range(c)] if masks and rng.random() < 0.5
                          else None))
    return out


@pytest.mark.parametrize("masks", [False, True])
@pytest.mark.parametrize("token_level", [False, True])
def test_make_train_chunk_matches_per_sample_packing(masks, token_level):
    rng = random.Random(7 + masks + 2 * token_level)
    samples = _samples(rng, 37, masks)
    adv = [rng.uniform(-2, 2) for _ in samples]
    tok = [[rng.uniform(-1, 1) for _ in s.completion_ids] for s in samples] if token_level else None
    chunk = make_train_chunk(samples, torch.tensor(adv) if not token_level else adv, pad_id=3, token_advantages=tok)
    ids, att, lm, lp, ad = _reference_chunk(samples, adv, 3, tok)
    assert torch.equal(chunk.input_ids, ids) and torch.equal(chunk.attention_mask, att)
    assert torch.equal(chunk.loss_mask, lm) and torch.equal(chunk.gen_logprobs, lp)
    assert torch.equal(chunk.advantages, ad)
    assert chunk.sample_mask.tolist() == [0.0 if s.env_mask else 1.0 for s in samples]
    assert chunk.start_versions.tolist() == [s.start_version for s in samples]
    assert (chunk.input_ids.dtype, chunk.loss_mask.dtype, chunk.advantages.dtype) == \
        (torch.long, torch.float32, torch.float32)


def test_make_train_chunk_rejects_misaligned_samples_and_packs_nothing():
    s = Sample(prompt_ids=[1], completion_ids=[2, 3], gen_logprobs=[-1.0], reward=0.0, finish_reason="stop",
               start_version=0, end_version=0)
    with pytest.raises(ValueError, match="1 generation logprobs for 2 completion tokens"):
        make_train_chunk([s], [0.0])
    with pytest.raises(ValueError, match="2 advantages for 1 samples"):
        make_train_chunk([Sample([1], [2], [-1.0], 0.0, "stop", 0, 0)], [0.0, 1.0])
    empty = make_train_chunk([], [])
    assert empty.input_ids.shape == (0, 0) and empty.num_samples == 0


def test_group_seeds_are_consecutive_from_derive_seed():
    # sample i of a group: (derive_seed(*parts) + i) mod 2^63, as a server's n choices of one
    # request with seed derive_seed(*parts) are seeded (vLLM: seed + i), wrapping below 2^63
    rng = random.Random(0)
    for _ in range(200):
        parts = [rng.randrange(-3, 1 << 66) for _ in range(rng.randrange(4))]
        i = rng.randrange(64)
        assert seed_last(seed_prefix(*parts), i) == (derive_seed(*parts) + i) % 2 ** 63
    top = (2 ** 63 - 3) << 1  # a prefix whose group's seeds wrap
    assert [seed_last(top, i) for i in range(5)] == [2 ** 63 - 3, 2 ** 63 - 2, 2 ** 63 - 1, 0, 1]
    p = SamplingParams(temperature=0.7, stop_token_ids=(1, 2))
    q = with_seed(p, 11)
    assert q.seed == 11 and p.seed is None and (q.temperature, q.stop_token_ids) == (0.7, (1, 2))


def _scan(buf: ReplayBuffer):
    slots = list(buf._slots.values())
    ready = sorted((s for s in slots if s.state == SlotState.READY), key=lambda s: s.dispatch_index)
    reserved = sorted((s for s in slots if s.state == SlotState.RESERVED), key=lambda s: s.dispatch_index)
    return ready, reserved


def test_buffer_indexes_agree_with_a_scan_through_every_transition():
    async def go():
        rng = random.Random(3)
        buf = ReplayBuffer(capacity=40)
        nxt = 0
        selected = []
        for _ in range(400):
            ready, reserved = _scan(buf)
            assert buf.ready() == ready and buf.reserved() == reserved
            assert buf.live() == len(ready) + len(reserved) and buf.num_ready() == len(ready)
            for t in {s.target_step for s in ready}:
                assert buf.ready_for_target(t) == [s for s in ready if s.target_step == t]
            assert set(buf.ready_targets()) == {s.target_step for s in ready}
            op = rng.randrange(5)
            if op == 0 and buf.has_capacity():
                buf.reserve(f"g{nxt}", nxt, nxt, 0, 0, rng.choice([None, 0, 1, 2]))
                nxt += 1
            elif op == 1 and reserved:
                s = rng.choice(reserved)
                await buf.commit(s.group_id, PromptGroup(s.group_id, 0, 0, {}, [], 0, 0, s.target_step))
            elif op == 2 and ready:
                pick = rng.sample(ready, rng.randrange(1, len(ready) + 1))
                state = rng.choice([SlotState.SELECTED, SlotState.EVICTED])
                await buf.finish(pick, state)
                if state == SlotState.SELECTED:
                    selected += pick
            elif op == 3 and reserved:
                await buf.finish([rng.choice(reserved)], SlotState.ABORTED)
            elif op == 4 and selected:
                back, selected = selected[:3], selected[3:]
                await buf.restore_ready(back)
        state = buf.state_dict()
        other = ReplayBuffer(capacity=40)
        other.load_state_dict(state)
        assert [s.group_id for s in other.ready()] == [s.group_id for s in buf.ready()]
        assert other.live() == len(buf.ready()) and other.reserved() == []

    asyncio.run(go())


def test_controller_raises_gc_thresholds_while_the_pumps_run_and_restores_them(tmp_path):
    import gc

    from tests.helpers.fakes import make_parts
    from rl_core.config import validate_dict
    from rl_core.controller.controller import Controller
    from rl_core.metrics.gc_pauses import RUN_THRESHOLDS

    cfg = validate_dict({"grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_num_steps": 2},
                         "validation": {"val_at_start": False, "val_at_end": False},
                         "logging": {"tensorboard": False, "jsonl": False, "progress": "off"}})
    ctl = Controller(cfg, make_parts(cfg), tmp_path, total_steps=2)
    seen = []
    ctl.step_observers.append(lambda record: seen.append(gc.get_threshold()))
    before = gc.get_threshold()
    asyncio.run(ctl.run())
    assert seen and all(t[0] >= RUN_THRESHOLDS[0] for t in seen)
    assert gc.get_threshold() == before


class _CountingBackend:
    """FakeBackend-like: records how many generations run at once and, at every start, how
    many dispatched samples are still waiting for a generation place."""

    def __init__(self, inner):
        self.inner, self.running, self.max_running, self.max_queued, self.ctl = inner, 0, 0, 0, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request):
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        self.max_queued = max(self.max_queued, self.ctl.rollout._queued_samples())
        try:
            return await self.inner.generate(request)
        finally:
            self.running -= 1


@pytest.mark.parametrize("sampler", [{"type": "in_order", "max_lookahead_versions": 1},
                                     {"type": "windowed", "max_staleness_versions": 1}])
def test_generation_level_backpressure_caps_running_and_queued_samples(tmp_path, sampler):
    from tests.helpers.fakes import FakeBackend, make_parts
    from rl_core.config import validate_dict
    from rl_core.controller.controller import Controller

    n, cap = 4, 8
    cfg = validate_dict({
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": n, "max_num_steps": 5},
        "async_rl": {"sampler": sampler, "max_inflight_groups": 16, "max_inflight_generations": cap,
                     "max_buffered_groups": 16},
        "validation": {"val_at_start": False, "val_at_end": False},
        "logging": {"tensorboard": False, "jsonl": False, "progress": "off"}})
    backend = _CountingBackend(FakeBackend(seed=2, max_latency_s=0.01))
    ctl = Controller(cfg, make_parts(cfg, backend=backend, num_examples=200), tmp_path, total_steps=5)
    backend.ctl = ctl
    summary = asyncio.run(ctl.run())
    assert summary["rl_steps"] == 5
    assert backend.max_running == cap, "the generation places were never all in use"
    # at most one group's worth waits, plus the group whose dispatch that allowed (n - 1 + n)
    assert backend.max_queued <= 2 * n - 1, backend.max_queued
    assert ctl.rollout.opts.gen_slots.queued == 0 and not ctl.rollout._unstarted


def test_generation_slots_count_queued_samples_of_multi_turn_and_failed_groups():
    from tests.helpers.fakes import FakeBackend, FakeEnv, FakeTokenizer
    from rl_core.rollout.group import GenerationSlots, GroupOptions, generate_group

    class TwoTurnEnv(FakeEnv):
        max_turns = 2

        def parse_completion(self, ids, text, finish):
            return {"ids": ids}

        def observe(self, example, turn, parsed):
            return [7, 7]

        def score_turns(self, example, turns):
            return self.score(example, turns[-1]["ids"], "", "stop")

    async def go():
        slots = GenerationSlots(3)
        seen = []
        slots.on_queue_shrunk = lambda: seen.append(slots.queued)
        opts = GroupOptions(gen_slots=slots)
        ex = {"id": 1, "prompt": "1", "answer": "x"}
        samples = await asyncio.gather(*(generate_group(FakeBackend(seed=g), TwoTurnEnv(), FakeTokenizer(), ex, [1, 2],
                                                        4, SamplingParams(), f"g{g}", (0, g), opts) for g in range(3)))
        assert all(len(s) == 4 for s in samples) and slots.queued == 0
        assert max(seen) < 12 and seen[-1] == 0  # each sample counted once (its first turn), never below 0
        boom = FakeBackend(seed=5, fail=lambda r: RuntimeError("boom") if r.request_id.endswith("/0") else None)
        with pytest.raises(RuntimeError):
            await generate_group(boom, FakeEnv(), FakeTokenizer(), ex, [1], 4, SamplingParams(), "f", (0,), opts)
        assert slots.queued == 0  # the cancelled samples of the failed group stop counting

    asyncio.run(go())


def test_make_train_chunk_packs_arrays_and_lists_alike():
    """A backend may hand token ids and logprobs over as NumPy arrays (packed by concatenation):
    the tensors are exactly those of the same samples as Python lists, mixed or not."""
    import numpy as np

    from rl_core.columns import logprob_array, token_array

    rng = random.Random(11)
    lists = _samples(rng, 29, masks=True)
    shared_prompt = [4, 5, 6]
    for s in lists[:10]:  # a group's samples share their prompt list
        s.prompt_ids = shared_prompt
    arrays = [Sample(s.prompt_ids, token_array(s.completion_ids), logprob_array(s.gen_logprobs), s.reward,
                     s.finish_reason, s.start_version, s.end_version, env_mask=s.env_mask,
                     completion_mask=s.completion_mask) for s in lists]
    mixed = [a if i % 2 else s for i, (s, a) in enumerate(zip(lists, arrays))]
    adv = torch.tensor([rng.uniform(-2, 2) for _ in lists])
    ref = make_train_chunk(lists, adv, pad_id=7)
    for other in (arrays, mixed):
        got = make_train_chunk(other, adv, pad_id=7)
        for k in ("input_ids", "attention_mask", "loss_mask", "gen_logprobs", "advantages", "sample_mask",
                  "start_versions"):
            assert torch.equal(getattr(got, k), getattr(ref, k)), k
    none = make_train_chunk(arrays, None, pad_id=7)  # advantages filled in later (the advantage stage)
    assert torch.equal(none.advantages, torch.zeros_like(ref.advantages))
    assert isinstance(arrays[0].completion_ids, np.ndarray)


def test_sequence_advantages_broadcast_with_the_same_bits():
    """estimate.broadcast_sequence_advantages (one NumPy pass) == (adv[:, None] * mask in float64).to(float32), also
    for negative advantages (signed zeros) and masks that are not 0/1."""
    from rl_core.algorithms.estimate import broadcast_sequence_advantages

    g = torch.Generator().manual_seed(5)
    adv = torch.randn(64, generator=g, dtype=torch.float64) * 3
    adv[::7] = 0.0
    for mask in ((torch.rand(64, 33, generator=g) > 0.4).float(), torch.rand(64, 33, generator=g) * 2 - 0.5):
        ref = (adv[:, None] * mask.to(torch.float64)).to(torch.float32)
        got = broadcast_sequence_advantages(adv, mask)
        assert got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))  # bit for bit, signed zeros too


class _GroupBackend:
    """A deterministic backend (tokens from the request's seed) with or without generate_many."""

    def __init__(self, group_calls: bool):
        self.requests, self.many_calls, self.version = [], 0, 0
        if not group_calls:
            self.generate_many = None

    def _answer(self, request):
        from rl_core.types import GenerationResult

        r = random.Random(request.params.seed)
        k = 1 + r.randrange(6)
        return GenerationResult(request.request_id, request.prompt_ids, [r.randrange(1, 50) for _ in range(k)],
                                [-r.random() for _ in range(k)], "stop" if k < 6 else "length", 0, 0)

    async def generate(self, request):
        self.requests.append((request.request_id, request.params.seed, list(request.prompt_ids)))
        await asyncio.sleep(0)
        return self._answer(request)

    async def generate_many(self, requests):
        self.many_calls += 1
        for q in requests:
            self.requests.append((q.request_id, q.params.seed, list(q.prompt_ids)))
        await asyncio.sleep(0)
        return [self._answer(q) for q in requests]


def _strip(samples):
    out = []
    for s in samples:
        info = {k: v for k, v in s.info.items() if k not in ("generate_s", "env_s")}
        out.append((list(s.prompt_ids), list(s.completion_ids), list(s.gen_logprobs), s.reward, s.rewards,
                    s.finish_reason, s.env_mask, info, s.completion_mask))
    return out


def _four_groups(env_timeout_s):
    """(an async function generating four groups of 8 through `generate_group` with a backend,
    the sampling params it passes)."""
    from rl_core.rollout.group import GroupOptions, generate_group
    from tests.helpers.fakes import FakeEnv, FakeTokenizer

    env, tok = FakeEnv(), FakeTokenizer()
    params = SamplingParams(temperature=1.0, max_tokens=6)
    opts = GroupOptions(env_timeout_s=env_timeout_s, generation_timeout_s=30.0)

    async def run(backend):
        out = []
        for i in range(4):
            ex = {"id": i, "prompt": str(i), "answer": "x"}
            out.append(await generate_group(backend, env, tok, ex, env.prompt_ids(ex), 8, params, f"g{i}",
                                            (3, 0, i), opts))
        return out

    return run, params


@pytest.mark.parametrize("env_timeout_s", [None, 5.0])
def test_one_generate_many_call_per_group_gives_the_samples_of_a_call_per_sample(env_timeout_s):
    run, params = _four_groups(env_timeout_s)

    per_sample, grouped = _GroupBackend(group_calls=False), _GroupBackend(group_calls=True)
    a, b = asyncio.run(run(per_sample)), asyncio.run(run(grouped))
    assert grouped.many_calls == 4 and per_sample.requests == grouped.requests  # same ids, seeds, order
    assert [_strip(g) for g in a] == [_strip(g) for g in b]
    assert all(s.prompt_ids is g[0].prompt_ids for g in b for s in g)  # one prompt list per group


def test_multi_turn_and_generation_places_keep_a_call_per_sample():
    from rl_core.rollout.group import GenerationSlots, GroupOptions, group_call_ok
    from tests.helpers.fakes import FakeEnv

    backend, env = _GroupBackend(group_calls=True), FakeEnv()
    assert group_call_ok(backend, env, GroupOptions())
    assert not group_call_ok(_GroupBackend(group_calls=False), env, GroupOptions())

    async def with_slots():
        return group_call_ok(backend, env, GroupOptions(gen_slots=GenerationSlots(8)))

    assert not asyncio.run(with_slots())
    multi = FakeEnv()
    multi.max_turns = 3
    assert not group_call_ok(backend, multi, GroupOptions())
    agent = FakeEnv()
    agent.runs_episodes = True
    assert not group_call_ok(backend, agent, GroupOptions())

    class Wrapper:  # overrides generate, hands the rest to the inner backend: its generate must run
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        async def generate(self, request):
            return await self.inner.generate(request)

    class Subclass(_GroupBackend):  # overrides only generate
        async def generate(self, request):
            return await super().generate(request)

    class Both(Subclass):
        async def generate_many(self, requests):
            return await super().generate_many(requests)

    assert not group_call_ok(Wrapper(backend), env, GroupOptions())
    assert not group_call_ok(Subclass(group_calls=True), env, GroupOptions())
    assert group_call_ok(Both(group_calls=True), env, GroupOptions())


def test_array_samples_go_into_the_spool_and_checkpoints_as_json_lists():
    import json
    from types import SimpleNamespace

    from rl_core.checkpoint.run_state import group_from_json, group_to_json
    from rl_core.rollout.spool import step_record
    from rl_core.columns import logprob_array, token_array

    s = Sample([1, 2], token_array([5, 6, 7]), logprob_array([-0.5, -0.25, -1.0]), 1.0, "stop", 0, 1,
               info={"token_versions": token_array([0, 1, 1])})
    g = PromptGroup("g0", 3, 0, {"id": 3}, [s], 0, 1, 0)
    rec = json.loads(json.dumps(step_record(1, 1, [SimpleNamespace(group=g, advantages=[0.5], staleness=0)])))
    got = rec["groups"][0]["samples"][0]
    assert (got["completion_ids"], got["gen_logprobs"], got["token_versions"]) == \
        ([5, 6, 7], [-0.5, -0.25, -1.0], [0, 1, 1])
    back = group_from_json(json.loads(json.dumps(group_to_json(g))))
    assert back.samples[0].completion_ids == [5, 6, 7] and back.samples[0].gen_logprobs == [-0.5, -0.25, -1.0]
    assert back.samples[0].info["token_versions"] == [0, 1, 1]


class _ColumnBackend(_GroupBackend):
    """`_GroupBackend` with the columns group call too (`generate_group`), answering each sample
    as its request `f"{key}/{i}"` with seed `seeds[i]` would be answered."""

    def __init__(self, group_calls: bool = True, columns: bool = True):
        super().__init__(group_calls)
        self.group_calls_made = 0
        if not columns:
            self.generate_group = None

    async def generate_group(self, key, prompt_ids, params, seeds):
        from rl_core.types import group_requests
        from rl_core.columns import GroupResults

        self.group_calls_made += 1
        requests = group_requests(key, prompt_ids, params, seeds)
        for q in requests:
            self.requests.append((q.request_id, q.params.seed, list(q.prompt_ids)))
        await asyncio.sleep(0)
        return GroupResults.of([self._answer(q) for q in requests])


@pytest.mark.parametrize("env_timeout_s", [None, 5.0])
def test_a_generate_group_call_gives_the_samples_of_generate_many_and_of_a_call_per_sample(env_timeout_s):
    from rl_core.columns import GroupSamples

    run, params = _four_groups(env_timeout_s)

    columns, many = _ColumnBackend(), _ColumnBackend(columns=False)
    per_sample = _ColumnBackend(group_calls=False, columns=False)
    a, b, c = asyncio.run(run(per_sample)), asyncio.run(run(many)), asyncio.run(run(columns))
    assert columns.group_calls_made == 4 and columns.many_calls == 0  # generate_group is preferred
    assert many.group_calls_made == 0 and many.many_calls == 4  # turned off on the instance: generate_many
    assert per_sample.requests == many.requests == columns.requests  # the same ids, seeds, prompts, order
    assert params.seed is None  # the caller's params are never modified
    assert all(type(g) is GroupSamples and not g.built for g in b + c)  # nothing built by generating
    assert [_strip(g) for g in a] == [_strip(g) for g in b] == [_strip(g) for g in c]
    for g in c:
        assert len(g.env_s) == 8 and all(t >= 0.0 for t in g.env_s) and g.generate_s >= 0.0
        assert all(s.prompt_ids is g[0].prompt_ids for s in g)  # one prompt list per group


def test_group_call_choice_and_a_generate_group_answer_of_the_wrong_shape():
    from rl_core.rollout.group import GroupOptions, generate_group, group_call
    from rl_core.columns import GroupResults
    from tests.helpers.fakes import FakeEnv, FakeTokenizer

    env = FakeEnv()
    assert group_call(_ColumnBackend(), env, GroupOptions()) == "generate_group"
    assert group_call(_ColumnBackend(columns=False), env, GroupOptions()) == "generate_many"
    assert group_call(_ColumnBackend(group_calls=False), env, GroupOptions()) == "generate_group"
    assert group_call(_ColumnBackend(group_calls=False, columns=False), env, GroupOptions()) is None

    class OnlyGenerate(_ColumnBackend):  # overrides generate only: neither group call may bypass it
        async def generate(self, request):
            return await super().generate(request)

    assert group_call(OnlyGenerate(), env, GroupOptions()) is None

    class Short(_ColumnBackend):
        async def generate_group(self, key, prompt_ids, params, seeds):
            full = await super().generate_group(key, prompt_ids, params, seeds)
            return GroupResults(full.token_ids[:-1], full.logprobs[:-1], full.finish_reasons[:-1],
                                full.start_versions[:-1], full.end_versions[:-1])

    class Listed(_ColumnBackend):
        async def generate_group(self, key, prompt_ids, params, seeds):
            return await self.generate_many(group_requests(key, prompt_ids, params, seeds))

    from rl_core.types import group_requests

    ex = {"id": 0, "prompt": "0", "answer": "x"}

    def run(backend):
        return asyncio.run(generate_group(backend, env, FakeTokenizer(), ex, env.prompt_ids(ex), 4,
                                          SamplingParams(max_tokens=6), "g0", (1, 0, 0)))

    with pytest.raises(RuntimeError, match="generate_group returned 3 completions"):
        run(Short())
    with pytest.raises(TypeError, match="expected rl_core.columns.GroupResults"):
        run(Listed())


def test_group_results_of_per_sample_results_and_group_samples_of_columns_agree():
    from rl_core.types import EnvResult, GenerationResult
    from rl_core.columns import GroupResults, GroupSamples

    results = [GenerationResult(f"k/{i}", [1], [i + 1] * (i + 1), [-0.5] * (i + 1), "stop", 0, 1 + i % 2,
                                token_versions=[1] * (i + 1) if i == 2 else None, worker="w1" if i == 1 else "")
               for i in range(4)]
    cols = GroupResults.of(results)
    assert cols.workers == ["", "w1", "", ""] and cols.token_versions == [None, None, [1, 1, 1], None]
    assert cols.routed_experts is None and len(cols) == 4
    same = GroupResults.of(results[:1] * 3)
    assert same.workers is None and same.worker == "" and same.token_versions is None
    scores = [EnvResult(float(i), {"a": float(i)}, i == 3, {"n": i}) for i in range(4)]
    texts = ["t"] * 4
    a = GroupSamples([1], results, texts, scores, 0.5, [0.1] * 4, True)
    b = GroupSamples([1], GroupResults.of(results), texts, scores, 0.5, [0.1] * 4, True)
    for name in ("completion_ids", "gen_logprobs", "completion_lens", "finish_reasons", "start_versions",
                 "end_versions", "token_versions", "workers", "routed_experts", "rewards", "env_mask"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.worker_totals() == b.worker_totals() == {"local": 1 + 3 + 4, "w1": 2}
    assert a.samples() == b.samples()
