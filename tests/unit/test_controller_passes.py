"""The tenth round of issue 18 item 3 (docs/controller.md, "What we learned"): the step metrics'
per-group loop turned into passes over all groups, `GroupScores.check` comparing lengths
without dicts, one notify per committed group, rewards to float64 through NumPy; each gives
what the code before gave. Step metrics' accuracy, zero-variance, segment and worker counts
against a loop per group; `GroupScores.check` on every column shape; the advantage estimate
of rewards given as a list, a tuple and a tensor; a commit waking the buffer's waiters. Also
pinned, as the step metrics read them: `DictColumns.joined` against a join per group,
`DictColumns.of_columns`, `envs.base.distinct_scored` (one scorer call per distinct pair, in
order), and a chunk of groups held both ways."""

from __future__ import annotations

import asyncio
import math
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rl_core.algorithms.estimate import estimate_advantages
from rl_core.buffer.replay_buffer import ReplayBuffer
from rl_core.columns import DictColumns, GroupScores, group_columns
from rl_core.config import validate_dict
from rl_core.controller.ledger import PumpLedger
from rl_core.controller.step_metrics import step_metrics
from rl_core.envs.base import distinct_scored
from rl_core.packing import make_group_chunk, make_train_chunk
from rl_core.types import PromptGroup, scored_sample
from tests.unit.test_group_columns import InfoEnv, SeededBackend, _groups


def _pump():
    return PumpLedger()  # the run's counters step_metrics reads, all zero


def _trained(groups):
    slot = SimpleNamespace(ready_at=1.0, selected_at=2.0)
    return [SimpleNamespace(group=SimpleNamespace(samples=g, epoch=0), advantages=[0.5 * (i % 3)] * len(g),
                            staleness=i % 2, slot=slot) for i, g in enumerate(groups)]


def _counts_per_group(groups):
    """Accuracy, zero-variance groups, segment breaks and tokens per worker, one group at a time
    (the loop the step metrics ran before the tenth round)."""
    correct = breaks = zero_variance = 0
    workers: dict = {}
    for cols in map(group_columns, groups):
        rs = cols.rewards
        zero_variance += len(rs) > 0 and rs.count(rs[0]) == len(rs)
        oks = cols.info_columns.column("correct")
        correct += sum(bool(ok) if ok is not None else r > 0 for ok, r in zip(oks, rs))
        if cols.info_columns.has("segments"):
            breaks += sum(v - 1 for v in cols.info_columns.column("segments", 1))
        for w, c in cols.worker_totals().items():
            workers[w] = workers.get(w, 0) + c
    return correct, zero_variance, breaks, workers


def _sample(reward, info, worker="local", n=3):
    return scored_sample([1, 2], list(range(n)), [-0.5] * n, None, "stop", 0, 0, None, "t", reward, {"r": reward},
                         False, dict(info), 0.1, 0.01, {worker: n}, 1)


def _plain_groups():
    """Groups held as `Sample`s: some samples without `correct`, info dicts with different keys,
    agent segments, several workers, a group whose rewards are all equal."""
    return [
        [_sample(1.0, {"correct": True}), _sample(0.0, {}), _sample(0.5, {"correct": None})],
        [_sample(1.0, {"correct": False, "segments": 3}, "w1"), _sample(1.0, {"segments": 1}, "w2", 5)],
        [_sample(0.0, {"correct": 0}), _sample(0.0, {"correct": 1}, "w2")],
        [_sample(-1.0, {}), _sample(2.0, {"segments": 2})],
    ]


@pytest.mark.parametrize("shape", ["columns", "samples", "plain", "mixed"])
def test_step_metrics_counts_are_the_per_group_counts(shape):
    if shape == "plain":
        groups = _plain_groups()
    else:
        groups = _groups(SeededBackend(True), n_groups=7)
        if shape == "samples":
            groups = [list(g) for g in groups]
        elif shape == "mixed":
            groups = [list(g) if i % 2 else g for i, g in enumerate(groups)] + _plain_groups()
    correct, zero_variance, breaks, workers = _counts_per_group(groups)
    m = step_metrics(_pump(), 0, _trained(groups), {}, {}, 0.0, 0.0)
    n = sum(map(len, groups))
    assert m["train/accuracy"] == correct / n
    assert m["train/zero_variance_groups"] == zero_variance / len(groups)
    assert m["rollout/agent_segment_breaks"] == float(breaks)
    assert {k: v for k, v in m.items() if k.startswith("rollout/worker_gen_tokens/")} == {
        f"rollout/worker_gen_tokens/{w}": float(c) for w, c in sorted(workers.items())}
    advs = [a for t in _trained(groups) for a in t.advantages]
    assert m["train/advantage_abs_mean"] == statistics.fmean([abs(a) for a in advs])  # bit for bit
    if shape == "plain":  # the fixture's own counts, so that the reference itself is checked
        assert (correct, zero_variance, breaks) == (5, 2, 3) and workers == {"local": 18, "w1": 3, "w2": 8}


def test_abs_mean_is_fmean_bit_for_bit_on_awkward_values():
    rng = np.random.default_rng(3)
    for values in (rng.normal(size=1001).tolist(), [1e16, 1.0, -1e16, 3.0] * 7, [0.1] * 10, [-0.0, 5e-324, 1e308]):
        assert math.fsum(map(abs, values)) / len(values) == statistics.fmean(list(map(abs, values)))


def _joined_per_group(groups, key, default=None):
    return [v for c in groups for v in c.column(key, default)]


def test_dict_columns_joined_equals_the_join_per_group():
    col = DictColumns([{"a": 1, "b": 2.0}, {"a": 3, "b": 4.0}])
    col2 = DictColumns.of_columns(3, {"a": [5, 6, 7], "b": (8.0, 9.0, 10.0)})
    missing = DictColumns([{"b": 1.0}])
    ragged = DictColumns([{"a": 11}, {"b": 12}])  # different keys: held as dicts
    assert ragged.dicts is not None and col.dicts is None
    empty = DictColumns([])
    for groups in ([col, col2], [col, missing, col2], [ragged, col], [col2, ragged, missing], [empty, col], []):
        for key, default in (("a", None), ("a", 0.0), ("b", -1), ("zzz", None)):
            got = DictColumns.joined(groups, key, default)
            assert got == _joined_per_group(groups, key, default) and type(got) is list
    joined = DictColumns.joined([col, col2], "a")
    joined.append(99)  # a new list: the groups' columns are left as they are
    assert col.column("a") == [1, 3] and col2.column("a") == [5, 6, 7]


def test_of_columns_takes_lists_over_and_copies_other_sequences():
    a, b = [1.0, 2.0], (3.0, 4.0)
    c = np.array([True, False])
    got = DictColumns.of_columns(2, {"a": a, "b": b, "c": c})
    assert got.values["a"] is a and got.values["b"] == [3.0, 4.0] and type(got.values["b"]) is list
    assert type(got.values["c"]) is list and got.values["c"] == [True, False]
    assert list(got.values) == ["a", "b", "c"] and got.keys == ("a", "b", "c")
    only_lists = {"x": [1], "y": [2]}
    held = DictColumns.of_columns(1, only_lists)
    assert held.values == only_lists and held.values is not only_lists  # the caller's dict is not kept
    assert DictColumns.of_columns(0, {}).rows() == []


@pytest.mark.parametrize("components, infos, ok", [
    ({"a": [1, 2, 3]}, {"k": ["x", "y", "z"]}, True),
    ([{}, {}, {}], [{"k": 1}, {}, {"j": 2}], True),
    ({}, {}, True),
    ({"a": [1, 2]}, {}, False),
    ({"a": [1, 2, 3], "b": [1, 2, 3, 4]}, {}, False),
    ({}, [{}, {}], False),
    ([{}, {}, {}], {"k": [1, 2, 3], "j": []}, False),
])
def test_group_scores_check_accepts_and_refuses_as_before(components, infos, ok):
    scores = GroupScores([0.0, 1.0, 0.5], components, None, infos)
    if ok:
        scores.check(3, "Env.score_group")
        return
    with pytest.raises(ValueError, match=r"Env.score_group returned .* entries for a group of 3 completions"):
        scores.check(3, "Env.score_group")


def test_group_scores_check_names_every_bad_column():
    scores = GroupScores([0.0], {"a": [1, 2, 3], "b": [1, 2]}, [False, True, True], {"k": [1, 2, 3]})
    with pytest.raises(ValueError) as e:
        scores.check(3, "E.score_group")
    assert "rewards (1), components['b'] (2) entries for a group of 3" in str(e.value)
    assert "masks" not in str(e.value) and "'a'" not in str(e.value)


def test_distinct_scored_scores_each_distinct_pair_once_in_order():
    calls = []

    def score(text, ended):
        calls.append((text, ended))
        return (text.upper(), float(len(text)) + ended, ended)

    texts = ["b", "a", "b", "b", "", "a", "c"]
    ended = [True, True, True, False, True, True, True]
    cols = distinct_scored(texts, ended, score, 3)
    assert calls == [("b", True), ("a", True), ("b", False), ("", True), ("c", True)]
    assert cols == [[t.upper() for t in texts], [float(len(t)) + e for t, e in zip(texts, ended)], ended]
    assert all(type(c) is list for c in cols)
    assert distinct_scored([], [], score, 4) == [[], [], [], []]


def test_distinct_scored_propagates_the_scorer_error_after_the_pairs_before():
    seen = []

    def score(text, ended):
        seen.append(text)
        if text == "bad":
            raise RuntimeError("cannot score")
        return (text,)

    with pytest.raises(RuntimeError, match="cannot score"):
        distinct_scored(["a", "a", "bad", "z"], [True] * 4, score, 1)
    assert seen == ["a", "bad"]


def test_advantages_of_rewards_as_a_list_equal_those_of_a_tensor():
    cfg = validate_dict({}).advantage
    groups = _groups(SeededBackend(True), n_groups=9)
    chunk = make_group_chunk(groups)
    rewards = [r for g in groups for r in g.rewards]
    rewards[3] = 1e300  # large, tiny and negative values convert the same way
    rewards[4] = -5e-324
    sizes = [len(g) for g in groups]
    a = estimate_advantages(cfg, chunk, rewards, sizes, binary_loss_mask=True)
    b = estimate_advantages(cfg, chunk, torch.tensor(rewards, dtype=torch.float64), sizes, binary_loss_mask=True)
    c = estimate_advantages(cfg, chunk, tuple(rewards), sizes, binary_loss_mask=True)
    for x in (b, c):
        assert torch.equal(a.advantages, x.advantages) and torch.equal(a.sample_advantages, x.sample_advantages)


def test_a_chunk_of_groups_held_both_ways_is_the_chunk_of_their_samples():
    groups = _groups(SeededBackend(True), n_groups=5, env=InfoEnv())
    mixed = groups[:3] + [list(g) for g in groups[3:]]  # columns, then built Samples
    chunk = make_group_chunk(mixed)
    ref = make_train_chunk([s for g in _groups(SeededBackend(True), n_groups=5, env=InfoEnv()) for s in g], None)
    for k in ("input_ids", "attention_mask", "loss_mask", "gen_logprobs", "sample_mask", "start_versions"):
        a, b = getattr(chunk, k), getattr(ref, k)
        assert a.dtype == b.dtype and torch.equal(a, b), k
    assert chunk.sample_mask.min() == 0  # some samples are masked out (InfoEnv flags length 5)


def test_a_commit_wakes_a_waiter_on_the_shared_condition():
    samples = _groups(SeededBackend(True), n_groups=1, env=InfoEnv())[0]

    async def run():
        cond = asyncio.Condition()
        buf = ReplayBuffer(4, cond)
        assert buf.changed is cond and ReplayBuffer(4).changed is not cond
        buf.reserve("g0", 0, 0, 0, 0, 0)
        woke = []

        async def waiter():
            async with cond:
                await cond.wait_for(lambda: buf.num_ready() > 0)
            woke.append(buf.num_ready())

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        group = PromptGroup("g0", 0, 0, {}, samples, 0, 0, 0)
        await buf.commit("g0", group)
        await asyncio.wait_for(task, 5)
        return woke

    assert asyncio.run(run()) == [1]
