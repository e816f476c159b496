"""The one column interface (`columns.group_columns`): a `GroupSamples` and the same group's
`Sample`s (built, or generated one call per sample) give equal columns; `SampleColumns` of
multi-turn samples; a group's seeds in one call, and many groups' seeds in one NumPy pass
(the rollout pump's); the correctly rounded square root of a fraction that
`step_metrics.pstdev` uses."""

from __future__ import annotations

import asyncio
import math
import random
from fractions import Fraction

import numpy as np
import pytest

from rl_core.controller.step_metrics import sqrt_of_fraction
from rl_core.rollout.group import (GroupOptions, consecutive_from, derive_seed, seed_last, seed_prefix,
                                   seeds_last, seeds_of_groups)
from rl_core.types import Sample
from rl_core.columns import GroupColumns, GroupSamples, SampleColumns, group_columns
from tests.unit.test_group_columns import SeededBackend, _groups

PER_SAMPLE = ("prompts", "prompt_lens", "completion_ids", "gen_logprobs", "completion_lens", "generated_lens",
              "finish_reasons", "rewards", "env_mask", "start_versions", "end_versions", "turns")


def _plain(column):
    return [v.tolist() if isinstance(v, np.ndarray) else v for v in column]


@pytest.mark.parametrize("arrays", [False, True])
def test_columns_of_a_group_are_the_same_whatever_its_shape(arrays):
    opts = GroupOptions(mask_flagged_samples=True)
    unbuilt = _groups(SeededBackend(arrays), opts=opts)
    built = _groups(SeededBackend(arrays), opts=opts)
    per_sample = _groups(SeededBackend(arrays, group_calls=False), opts=opts)
    for a, b, c in zip(unbuilt, built, per_sample):
        b.samples()
        ca, cb, cc = group_columns(a), group_columns(b), group_columns(c)
        assert ca is a and type(cb) is SampleColumns and type(cc) is SampleColumns
        assert isinstance(ca, GroupColumns) and group_columns(cb) is cb  # converted once, then as it is
        assert not a.built  # reading the interface built no Sample
        for name in PER_SAMPLE:
            assert _plain(getattr(ca, name)) == _plain(getattr(cb, name)) == _plain(getattr(cc, name)), name
        assert ca.completion_masks is None and cb.completion_masks is None and cc.completion_masks is None
        assert ca.routed_experts is None and cb.routed_experts is None
        assert ca.shared_prompt is a.prompt_ids and cb.shared_prompt is b.prompt_ids
        assert ca.worker_totals() == cb.worker_totals() == cc.worker_totals()
        assert ca.component_columns.rows() == cb.component_columns.rows() == cc.component_columns.rows()
        assert ca.info_columns.column("correct") == cb.info_columns.column("correct")
        assert cb.env_s == [s.info["env_s"] for s in b] and ca.env_s == a.env_s
        assert cb.generate_s_each == [b.generate_s] * len(b) and ca.generate_s_each == [a.generate_s] * len(a)


def test_sample_columns_of_multi_turn_samples():
    p = [1, 2]
    samples = [Sample(p, [5, 6, 7, 8], [-0.1] * 4, 1.0, "stop", 0, 1, completion_mask=[1, 0, 0, 1],
                      info={"turns": 2, "worker_tokens": {"a": 1, "b": 1}, "segments": 2}),
               Sample([9], [5], [-0.2], 0.0, "length", 1, 1, env_mask=True,
                      info={"worker_tokens": {"a": 1}}, routed_experts=[[1], [2]])]
    c = group_columns(samples)
    assert c.generated_lens == [2, 1] and c.completion_lens == [4, 1] and c.prompt_lens == [2, 1]
    assert c.completion_masks == [[1, 0, 0, 1], None] and c.turns == [2, 1] and c.shared_prompt is None
    assert c.worker_totals() == {"a": 2, "b": 1} and c.env_s == [0.0, 0.0] and c.env_mask == [False, True]
    assert c.routed_experts == [None, [[1], [2]]] and c.info_columns.column("segments", 1) == [2, 1]
    assert group_columns(samples[:1]).shared_prompt is p


def test_seeds_of_a_group_in_one_call_equal_one_call_per_sample():
    r = random.Random(3)
    for _ in range(300):
        prefix = seed_prefix(r.getrandbits(64), r.randrange(5), r.getrandbits(30))
        n = r.randrange(0, 33)
        assert seeds_last(prefix, n) == [seed_last(prefix, i) for i in range(n)]


def test_seeds_of_many_groups_in_one_pass_equal_the_seeds_of_each_group():
    r = random.Random(4)
    parts = [(r.choice([0, 1, -7, r.getrandbits(64), 2 ** 64 + 5, -(2 ** 70)]), r.randrange(5), r.getrandbits(30))
             for _ in range(500)]
    for n in (0, 1, 16, 33):
        got = seeds_of_groups(parts, n)
        assert got == [seeds_last(seed_prefix(*p), n) for p in parts]
        assert all(type(x) is int for row in got for x in row)
    assert seeds_of_groups([], 16) == []
    assert seeds_of_groups([(5,), (6,)], 3) == [[derive_seed(p) + i for i in range(3)] for p in (5, 6)]
    top = np.array([2 ** 63 - 3, 7], dtype=np.uint64)  # bases of groups, the first one's seeds wrap
    assert consecutive_from(top, 5) == [seeds_last(int(b) << 1, 5) for b in top.tolist()]
    assert consecutive_from(top, 5)[0] == [2 ** 63 - 3, 2 ** 63 - 2, 2 ** 63 - 1, 0, 1]


def test_a_group_given_its_seeds_is_the_group_that_derives_them():
    from rl_core.rollout.group import generate_group
    from rl_core.types import SamplingParams
    from tests.helpers.fakes import FakeTokenizer
    from tests.unit.test_group_columns import InfoEnv

    env, tok, params = InfoEnv(), FakeTokenizer(), SamplingParams(temperature=1.0, max_tokens=7)
    ex = {"id": 3, "prompt": "3", "answer": "x"}

    def run(backend, seeds):
        return asyncio.run(generate_group(backend, env, tok, ex, [1, 2], 8, params, "g3", (5, 0, 3),
                                          GroupOptions(), seeds))

    for backend in (SeededBackend(True), SeededBackend(True, group_calls=False)):
        given = run(backend, seeds_of_groups([(5, 0, 3)], 8)[0])
        derived = run(backend, None)
        assert [list(s.completion_ids) for s in given] == [list(s.completion_ids) for s in derived]
        assert [s.reward for s in given] == [s.reward for s in derived]
    with pytest.raises(ValueError, match="7 seeds for a group of 8"):
        run(SeededBackend(True), seeds_last(seed_prefix(5, 0, 3), 7))


def _correctly_rounded_sqrt(r: float, x: Fraction) -> bool:
    """r is the float nearest sqrt(x): x lies between the squares of the midpoints to r's
    neighbours (a tie goes to the even significand)."""
    lo, hi = math.nextafter(r, 0.0), math.nextafter(r, math.inf)
    mid_lo, mid_hi = (Fraction(lo) + Fraction(r)) / 2, (Fraction(r) + Fraction(hi)) / 2
    if not mid_lo ** 2 <= x <= mid_hi ** 2:
        return False
    if x in (mid_lo ** 2, mid_hi ** 2):  # a tie: r must have an even significand
        return math.frexp(r)[0] * 2 ** 53 % 2 == 0
    return True


def test_sqrt_of_fraction_is_correctly_rounded():
    r = random.Random(11)
    for _ in range(3000):
        num = r.getrandbits(r.randint(1, 160))
        den = r.getrandbits(r.randint(1, 160)) or 1
        got = sqrt_of_fraction(num, den)
        assert got is not None and (num == 0 and got == 0.0 or _correctly_rounded_sqrt(got, Fraction(num, den)))
    for num, den in ((4, 1), (1, 4), (2, 1), (9, 16), (10 ** 40, 3)):
        assert _correctly_rounded_sqrt(sqrt_of_fraction(num, den), Fraction(num, den))
    assert sqrt_of_fraction(1, 1 << 2100) is None  # subnormal: the caller falls back


def test_group_samples_is_one_of_the_interface():
    g = _groups(SeededBackend(True), n_groups=1)[0]
    assert type(g) is GroupSamples and isinstance(g, GroupColumns)
