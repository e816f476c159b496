"""A single-turn group held column-wise (`columns.GroupSamples`, issue 18 item 3) is the same
group as its `Sample`s: the records built on first access equal the per-sample path's, and
every consumer that reads the columns instead (packing, the advantage stage, step metrics,
the rollout pump's sums, the checkpoint JSON) gives what it gives for the `Sample`s. Also the
pieces the columnar path rests on: the reused chunk memory (`packing.ARENA`), the exact
`pstdev` over distinct values and the float32 broadcast of sequence advantages."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rl_core.config import validate_dict
from rl_core.controller.advantage_stage import AdvantageStage
from rl_core.controller.ledger import PumpLedger, RolloutStats
from rl_core.controller.step_metrics import pstdev, step_metrics
from rl_core.rollout.group import GroupOptions, generate_group
from rl_core.packing import ARENA, Arena, make_group_chunk, make_train_chunk
from rl_core.types import EnvResult, GenerationResult, PromptGroup, SamplingParams
from rl_core.columns import GroupSamples, columns_of
from tests.helpers.fakes import FakeEnv, FakeTokenizer

FIELDS = ("input_ids", "attention_mask", "loss_mask", "gen_logprobs", "advantages", "sample_mask", "start_versions")


class SeededBackend:
    """Deterministic results from the request's seed: completions of 0..7 tokens, as arrays
    (`arrays`) or lists, from one or two workers; `generate_many` optional."""

    def __init__(self, arrays: bool, group_calls: bool = True, ids_dtype=np.int64, lp_dtype=np.float32):
        self.arrays, self.ids_dtype, self.lp_dtype = arrays, ids_dtype, lp_dtype
        self.version = 3
        if not group_calls:
            self.generate_many = None

    def _answer(self, q):
        r = random.Random(q.params.seed)
        k = r.randrange(8)
        ids, lps = [r.randrange(1, 50) for _ in range(k)], [-r.random() * 4 for _ in range(k)]
        if self.arrays:
            ids, lps = np.array(ids, dtype=self.ids_dtype), np.array(lps, dtype=self.lp_dtype)
        return GenerationResult(q.request_id, q.prompt_ids, ids, lps, "length" if k == 7 else "stop", 2,
                                self.version, worker="w1" if r.random() < 0.5 else "")

    async def generate(self, q):
        return self._answer(q)

    async def generate_many(self, qs):
        return [self._answer(q) for q in qs]


class InfoEnv(FakeEnv):
    """Rewards in two components, a flagged sample now and then, `correct` in the info."""

    def score(self, example, completion_ids, completion_text, finish_reason):
        n = len(completion_ids)
        r = float((int(example["id"]) + n) % 3 == 0)
        return EnvResult(reward=r + 0.25 * (n % 2), rewards={"r": r, "odd": float(n % 2)}, mask=n == 5,
                         info={"correct": bool(r), "n": n})


def _groups(backend, n_groups=6, n=8, env=None, opts=None):
    env, tok = env or InfoEnv(), FakeTokenizer()
    params = SamplingParams(temperature=1.0, max_tokens=7)

    async def run():
        out = []
        for i in range(n_groups):
            ex = {"id": i, "prompt": str(i), "answer": "x"}
            out.append(await generate_group(backend, env, tok, ex, env.prompt_ids(ex)[:1 + i % 3], n, params, f"g{i}",
                                            (5, 0, i), opts or GroupOptions()))
        return out

    return asyncio.run(run())


def _same_sample(a, b):
    info_a = {k: v for k, v in a.info.items() if k not in ("generate_s", "env_s")}
    info_b = {k: v for k, v in b.info.items() if k not in ("generate_s", "env_s")}
    assert list(a.prompt_ids) == list(b.prompt_ids)
    assert list(a.completion_ids) == list(b.completion_ids) and list(a.gen_logprobs) == list(b.gen_logprobs)
    assert (a.reward, a.rewards, a.finish_reason, a.start_version, a.end_version, a.env_mask, a.completion_mask,
            a.routed_experts) == (b.reward, b.rewards, b.finish_reason, b.start_version, b.end_version, b.env_mask,
                                  b.completion_mask, b.routed_experts)
    assert info_a == info_b and list(info_a) == list(info_b)  # the same keys in the same order


@pytest.mark.parametrize("arrays", [False, True])
@pytest.mark.parametrize("mask_flagged", [True, False])
def test_a_group_call_gives_columns_whose_samples_are_the_per_sample_paths(arrays, mask_flagged):
    opts = GroupOptions(mask_flagged_samples=mask_flagged)
    per_sample = _groups(SeededBackend(arrays, group_calls=False), opts=opts)
    columns = _groups(SeededBackend(arrays), opts=opts)
    for ref, g in zip(per_sample, columns):
        assert isinstance(ref, list) and type(g) is GroupSamples
        assert columns_of(g) is g and not g.built  # nothing built by generating the group
        # the columns say what the samples say
        assert g.rewards == [s.reward for s in ref] and g.env_mask == [s.env_mask for s in ref]
        assert g.finish_reasons == [s.finish_reason for s in ref]
        assert g.completion_lens == [len(s.completion_ids) for s in ref]
        assert (g.start_versions, g.end_versions) == ([s.start_version for s in ref], [s.end_version for s in ref])
        assert g.components == [s.rewards for s in ref] and g.routed_experts is None
        assert len(g) == len(ref)
        for a, b in zip(g, ref):  # first access: the Samples are built
            _same_sample(a, b)
        assert g.built and columns_of(g) is None and g[0] is g.samples()[0]  # built once, kept
        assert [s.info["env_s"] for s in g] == g.env_s and {s.info["generate_s"] for s in g} == {g.generate_s}
        assert all(s.prompt_ids is g.prompt_ids for s in g)  # one prompt list per group
        assert g == list(g) and g == g.samples()


def test_a_backend_that_hands_back_another_prompt_gets_plain_samples_with_its_prompts():
    class OtherPrompt(SeededBackend):
        def _answer(self, q):
            res = super()._answer(q)
            res.prompt_ids = list(q.prompt_ids) + [99]
            return res

    for g in _groups(OtherPrompt(arrays=True)):
        assert isinstance(g, list) and all(s.prompt_ids[-1] == 99 for s in g)
    # an equal copy of the prompt (the native engine hands back list(request.prompt_ids)): columns, one list
    class CopiedPrompt(SeededBackend):
        def _answer(self, q):
            res = super()._answer(q)
            res.prompt_ids = list(q.prompt_ids)
            return res

    assert all(type(g) is GroupSamples for g in _groups(CopiedPrompt(arrays=True)))


def _reference_rows(samples, pad_id):
    """input_ids, attention, loss mask, gen logprobs of `samples`, one row at a time (torch)."""
    T = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    B = len(samples)
    ids, att = torch.full((B, T), pad_id, dtype=torch.long), torch.zeros((B, T), dtype=torch.long)
    lm, lp = torch.zeros((B, T)), torch.zeros((B, T))
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[i, :p] = torch.tensor(list(s.prompt_ids))
        ids[i, p:p + c] = torch.tensor([int(x) for x in s.completion_ids], dtype=torch.long)
        att[i, :p + c] = 1
        lm[i, p:p + c] = 1.0
        lp[i, p:p + c] = torch.tensor(np.asarray(s.gen_logprobs, dtype=np.float32))
    return ids, att, lm, lp


@pytest.mark.parametrize("dtypes", [(np.int64, np.float32), (np.int32, np.float64)])
def test_group_chunk_packs_the_columns_as_make_train_chunk_packs_the_samples(dtypes):
    arrays = _groups(SeededBackend(True, ids_dtype=dtypes[0], lp_dtype=dtypes[1]), n_groups=9)
    lists = _groups(SeededBackend(False), n_groups=9)
    built = _groups(SeededBackend(True), n_groups=9)
    for g in built[::2]:
        g.samples()  # some groups built: read through their Samples
    mixed = [a if i % 3 else list(a) for i, a in enumerate(_groups(SeededBackend(True), n_groups=9))]
    for groups in (arrays, lists, built, mixed):
        unbuilt = [g for g in groups if columns_of(g) is not None]
        got = make_group_chunk(groups, pad_id=3)
        assert all(columns_of(g) is not None for g in unbuilt)  # packing read the columns
        flat = [s for g in groups for s in list(g)]
        ref = make_train_chunk(flat, None, pad_id=3)
        for k in FIELDS:
            a, b = getattr(got, k), getattr(ref, k)
            assert a.dtype == b.dtype and torch.equal(a, b), k
        ids, att, lm, lp = _reference_rows(flat, 3)
        assert torch.equal(got.input_ids, ids) and torch.equal(got.attention_mask, att)
        assert torch.equal(got.loss_mask, lm) and torch.equal(got.gen_logprobs, lp)
        assert not torch.any(got.advantages) and got.routed_experts is None


@pytest.mark.parametrize("shared", [True, False])
def test_array_rows_pack_as_one_row_at_a_time_on_ragged_groups(shared):
    """Completions of 0..12 tokens, prompts of 0..5 (empty ones too), pad id 9: the array path
    (`_rows_by_concatenation`: two pieces per row and each run's prompt broadcast when a prompt
    list is shared by a run of rows; three pieces per row when every row has its own prompt
    list) writes what a row-at-a-time packing and the list path write."""
    from rl_core.types import Sample

    r = random.Random(8 if shared else 9)
    samples = []
    for g in range(7):
        prompt = [r.randrange(1, 50) for _ in range(r.choice([0, 1, 3, 5]))]
        for _ in range(r.choice([4, 5, 8])):
            k = r.choice([0, 1, 7, 12])
            ids = np.array([r.randrange(1, 50) for _ in range(k)], dtype=np.int64)
            lps = np.array([-r.random() for _ in range(k)], dtype=np.float32)
            samples.append(Sample(prompt if shared else list(prompt), ids, lps, 1.0, "stop", 0, 1))
    as_lists = [Sample(list(s.prompt_ids), s.completion_ids.tolist(), s.gen_logprobs.tolist(), 1.0, "stop", 0, 1)
                for s in samples]
    got, ref = make_train_chunk(samples, None, pad_id=9), make_train_chunk(as_lists, None, pad_id=9)
    ids, att, lm, lp = _reference_rows(samples, 9)
    assert torch.equal(got.input_ids, ids) and torch.equal(got.attention_mask, att)
    assert torch.equal(got.loss_mask, lm) and torch.equal(got.gen_logprobs, lp)
    for k in FIELDS:
        assert torch.equal(getattr(got, k), getattr(ref, k)), k
    if shared:  # the same rows through the groups' columns (runs of whole groups)
        got = make_group_chunk([samples[i:j] for i, j in zip([0, 5, 13, 21], [5, 13, 21, len(samples)])], pad_id=9)
        assert torch.equal(got.input_ids, ids) and torch.equal(got.gen_logprobs, lp)


def test_advantage_stage_and_step_metrics_read_columns_as_they_read_samples():
    cfg = validate_dict({"advantage": {"exclude_invalid_from_stats": True}})
    groups = _groups(SeededBackend(True), n_groups=7)
    as_columns = [PromptGroup(f"g{i}", i, 0, {}, g, 0, 3) for i, g in enumerate(groups)]
    as_samples = [PromptGroup(f"g{i}", i, 0, {}, list(g), 0, 3) for i, g in enumerate(_groups(SeededBackend(True),
                                                                                               n_groups=7))]
    stage = AdvantageStage(cfg, None, None, pad_id=0)
    a, b = asyncio.run(stage.build(as_columns)), asyncio.run(stage.build(as_samples))
    assert not any(g.samples.built for g in as_columns)
    assert a.advantages == b.advantages and a.metrics == b.metrics
    for k in FIELDS:
        assert torch.equal(getattr(a.chunk, k), getattr(b.chunk, k)), k
    assert [g.rewards for g in as_columns] == [g.rewards for g in as_samples]

    pump = PumpLedger(rollout_stats=RolloutStats(dispatched_groups=7, committed_groups=7))  # what step_metrics reads

    def trained(groups, advs):
        slot = SimpleNamespace(ready_at=1.0, selected_at=2.0)
        return [SimpleNamespace(group=g, advantages=adv, staleness=i % 2, slot=slot)
                for i, (g, adv) in enumerate(zip(groups, advs))]

    ma = step_metrics(pump, 0, trained(as_columns, a.advantages), {}, {}, 0.0, 0.0)
    mb = step_metrics(pump, 0, trained(as_samples, b.advantages), {}, {}, 0.0, 0.0)
    assert not any(g.samples.built for g in as_columns)
    for m in (ma, mb):  # timings: the two sets of groups were generated at different times
        for k in ("timing/step_s", "throughput/trained_tokens_per_s", "rollout/generate_s_mean",
                  "rollout/generate_s_max", "rollout/env_s_mean", "rollout/env_s_max"):
            m.pop(k)
    assert ma == mb
    assert {"rollout/worker_gen_tokens/w1", "rollout/worker_gen_tokens/local", "reward/r", "reward/odd"} <= set(ma)


def test_a_column_group_goes_into_checkpoint_json_as_its_samples():
    from rl_core.checkpoint.run_state import group_from_json, group_to_json

    g = _groups(SeededBackend(True), n_groups=1)[0]
    cols = PromptGroup("g0", 0, 0, {"id": 0}, g, 0, 3, 0)
    plain = PromptGroup("g0", 0, 0, {"id": 0}, list(_groups(SeededBackend(True), n_groups=1)[0]), 0, 3, 0,
                        committed_at=cols.committed_at)
    a, b = group_to_json(cols), group_to_json(plain)
    for d in (a, b):
        for s in d["samples"]:
            s["info"].pop("generate_s"), s["info"].pop("env_s")
    assert json.dumps(a) == json.dumps(b)
    back = group_from_json(json.loads(json.dumps(group_to_json(cols))))
    assert [s.completion_ids for s in back.samples] == [s.completion_ids.tolist() for s in g]


def test_the_arena_reuses_memory_only_when_nothing_refers_to_it():
    arena = Arena(keep=3, min_bytes=1024)
    a = arena.empty((100, 50), np.int64)
    t = torch.from_numpy(a)[10:20]  # a slice of a tensor made from it keeps the memory
    del a
    b = arena.empty((100, 50), np.int64)
    assert b.ctypes.data != t.data_ptr() - 10 * 50 * 8 and arena.fresh_bytes > 2 * 40_000
    addr = t.data_ptr() - 10 * 50 * 8
    del t
    c = arena.empty((90, 50), np.float64)  # a smaller request fits the freed buffer
    assert c.ctypes.data == addr and c.shape == (90, 50) and c.dtype == np.float64
    fresh = arena.fresh_bytes
    del b, c
    for _ in range(5):  # nothing alive: the same buffers over and over
        x = arena.full((100, 50), 7, np.int64)
        assert int(x.sum()) == 7 * 5000
        del x
    assert arena.fresh_bytes == fresh and len(arena._bufs) <= 3
    held = [arena.empty((100, 50), np.int64) for _ in range(5)]  # all alive: more than `keep` exist, none reused
    assert len({h.ctypes.data for h in held}) == 5 and len(arena._bufs) >= 3
    del held
    arena.empty((100, 50), np.int64)  # released: the pool is trimmed back to `keep`
    assert len(arena._bufs) <= 3
    capped = Arena(keep=10, min_bytes=1024, max_bytes=100_000)  # at most ~2 buffers of 45 KB
    for _ in range(4):
        capped.empty((100, 50), np.int64)
    assert sum(b.nbytes for b in capped._bufs) <= 100_000
    kept = [capped.empty((100, 50), np.int64) for _ in range(4)]  # in use: never dropped from under an array
    assert len(capped._bufs) == 4 and len({k.ctypes.data for k in kept}) == 4
    small = arena.empty((4,), np.int64)  # below min_bytes: not pooled
    assert small.base is None or small.base.nbytes < 1024
    assert ARENA.keep >= 8


def test_pstdev_over_distinct_values_equals_statistics_pstdev():
    rng = random.Random(3)
    for trial in range(300):
        pool = [float(np.float32(rng.uniform(-3, 3))) for _ in range(rng.randrange(1, 6))] + [0.0, -0.0, 5e-324]
        vals = [rng.choice(pool) for _ in range(rng.randrange(1, 300))]
        assert pstdev(vals) == statistics.pstdev(vals), trial
    distinct = [rng.uniform(-1, 1) for _ in range(50)]  # mostly distinct: statistics.pstdev itself
    assert pstdev(distinct) == statistics.pstdev(distinct)
    assert pstdev([1, 1, 2, 2, 2]) == statistics.pstdev([1, 1, 2, 2, 2])  # ints
    for odd in ([float("nan")] * 8 + [1.0], [float("inf")] * 8 + [1.0]):  # not finite: whatever statistics does
        try:
            want = statistics.pstdev(odd)
        except Exception as exc:  # noqa: BLE001 - CPython 3.11 raises for a NaN or inf mean
            with pytest.raises(type(exc)):
                pstdev(odd)
        else:
            got = pstdev(odd)
            assert got == want or (np.isnan(got) and np.isnan(want))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the float64 pass over inf and NaN
def test_sequence_advantages_broadcast_in_float32_over_a_binary_mask_with_the_same_bits():
    from rl_core.algorithms.estimate import broadcast_sequence_advantages

    g = torch.Generator().manual_seed(9)
    mask = (torch.rand(300, 21, generator=g) > 0.3).float()
    for special in (False, True):
        adv = torch.randn(300, generator=g, dtype=torch.float64) * 4
        adv[::5], adv[1], adv[2], adv[3] = 0.0, -0.0, -1e-300, 1e-46  # zeros, signed zeros, float32 underflow
        if special:
            adv[4], adv[5], adv[6] = 1e300, float("inf"), float("nan")  # float32 overflow: the float64 pass
        ref = (adv[:, None] * mask.to(torch.float64)).to(torch.float32)
        got = broadcast_sequence_advantages(adv, mask, binary=True)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


def test_dynamic_sampling_reads_columns_as_it_reads_samples():
    from rl_core.algorithms.shaping import dynamic_sampling_filter

    class Constant(InfoEnv):  # every fourth group: one reward for all its samples
        def score(self, example, completion_ids, completion_text, finish_reason):
            if int(example["id"]) % 4 == 0:
                return EnvResult(reward=1.0, rewards={"r": 1.0, "odd": 0.0}, info={"correct": True})
            return super().score(example, completion_ids, completion_text, finish_reason)

    cols = [PromptGroup(f"g{i}", i, 0, {}, g, 0, 3) for i, g in enumerate(_groups(SeededBackend(True), 9,
                                                                                  env=Constant()))]
    plain = [PromptGroup(f"g{i}", i, 0, {}, list(g), 0, 3) for i, g in enumerate(_groups(SeededBackend(True), 9,
                                                                                         env=Constant()))]
    for use_components in (False, True):
        a, b = dynamic_sampling_filter(cols, use_components), dynamic_sampling_filter(plain, use_components)
        assert a == b and a[0].count(False) >= 3
    assert not any(g.samples.built for g in cols)


def test_dict_columns_hold_what_the_dicts_hold():
    from rl_core.columns import DictColumns

    uniform = [{"a": i, "b": -i} for i in range(5)]
    ragged = [{"a": 1}, {"b": 2, "a": 3}, {}, {"c": [4]}]
    for dicts in (uniform, ragged, [], [{}, {}]):
        c = DictColumns(dicts)
        rows = c.rows()
        assert rows == dicts and all(r is not d for r, d in zip(rows, dicts))
        assert [list(r) for r in rows] == [list(d) for d in dicts]  # key order kept
        assert c.rows() is not rows and c.rows() == rows  # new dicts each time
        for key in ("a", "b", "c", "z"):
            assert c.column(key, 0.0) == [d.get(key, 0.0) for d in dicts]
            assert c.has(key) == any(key in d for d in dicts)
        assert c.names() == {k for d in dicts for k in d}
    assert DictColumns(uniform).dicts is None and DictColumns(ragged).dicts is not None
    src = [{"a": [1]}, {"a": [2]}]
    c = DictColumns(src)
    src[0]["a"] = "changed"  # the caller's dict changed later: the columns keep what was given
    assert c.column("a") == [[1], [2]]


def test_environments_whose_infos_differ_per_sample_give_the_same_samples():
    class Ragged(InfoEnv):  # info and reward keys differ between samples
        def score(self, example, completion_ids, completion_text, finish_reason):
            res = super().score(example, completion_ids, completion_text, finish_reason)
            if len(completion_ids) % 2:
                res.info = {"n": len(completion_ids), "segments": 2}
                res.rewards = {"odd": 1.0}
            return res

    per_sample = _groups(SeededBackend(True, group_calls=False), env=Ragged())
    columns = _groups(SeededBackend(True), env=Ragged())
    for ref, g in zip(per_sample, columns):
        assert type(g) is GroupSamples and g.info_columns.dicts is not None
        assert g.info_columns.column("segments", 1) == [s.info.get("segments", 1) for s in ref]
        for a, b in zip(g, ref):
            _same_sample(a, b)


def _each_backend(fail_at=None):
    """A `generate` that answers in order of its seeds, fails sample `fail_at` once every sample
    has started, and records which requests it saw start, finish and get cancelled."""
    seen = {"started": [], "cancelled": [], "finished": []}
    all_started = asyncio.Event()

    async def generate(request):
        seen["started"].append(request.request_id)
        if len(seen["started"]) == n_samples:
            all_started.set()
        try:
            await all_started.wait()
            i = int(request.request_id.rsplit("/", 1)[1])
            if i == fail_at:
                raise RuntimeError(f"sample {i} failed")
            if fail_at is not None:
                await asyncio.sleep(3600)  # the others run until the failure cancels them
            await asyncio.sleep(0.001 * (n_samples - i))  # later samples finish first
        except asyncio.CancelledError:
            seen["cancelled"].append(request.request_id)
            raise
        seen["finished"].append(request.request_id)
        return GenerationResult(request.request_id, request.prompt_ids, [request.params.seed], [-0.5], "length", 3, 3)

    n_samples = 4
    return generate, seen


def test_generate_each_returns_sample_order_and_cancels_the_others_on_a_failure():
    from rl_core.columns import generate_each

    params = SamplingParams(max_tokens=1, temperature=1.0)
    generate, seen = _each_backend()
    got = asyncio.run(generate_each(generate, "g", [1, 2], params, [10, 11, 12, 13]))
    assert seen["started"] == ["g/0", "g/1", "g/2", "g/3"]  # started in sample order
    assert seen["finished"] == ["g/3", "g/2", "g/1", "g/0"]
    assert got.token_ids == [[10], [11], [12], [13]] and got.finish_reasons == ["length"] * 4  # sample order

    generate, seen = _each_backend(fail_at=2)

    async def failing():
        with pytest.raises(RuntimeError, match="sample 2 failed"):
            await generate_each(generate, "g", [1, 2], params, [10, 11, 12, 13])
        # the call raised only once the other three had been cancelled (a backend aborts them there)
        return sorted(seen["cancelled"]), seen["finished"]

    assert asyncio.run(failing()) == (["g/0", "g/1", "g/3"], [])
