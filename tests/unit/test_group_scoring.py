"""An environment's optional group scoring (`score_group` -> `columns.GroupScores`,
`protocols.GroupScoringEnvironment`): a group scored in one call is the group that a `score`
call per sample gives (columns and `Sample`s); the call is used only where it is the
environment's own (not below an override of `score`, not turned off, not with an environment
deadline); a wrong return fails the group with the environment's class named."""

from __future__ import annotations

import asyncio

import pytest

from rl_core.columns import GroupSamples, GroupScores
from rl_core.protocols import GroupScoringEnvironment
from rl_core.rollout.group import GroupOptions, generate_group, group_scoring
from rl_core.types import SamplingParams
from tests.helpers.fakes import FakeEnv, FakeTokenizer
from tests.unit.test_group_columns import InfoEnv, SeededBackend, _same_sample


class GroupInfoEnv(InfoEnv):
    """`InfoEnv`'s scores, also as one call per group (counted)."""

    def __init__(self):
        self.calls = {"score": 0, "score_group": 0}

    def score(self, example, completion_ids, completion_text, finish_reason):
        self.calls["score"] += 1
        return super().score(example, completion_ids, completion_text, finish_reason)

    def score_group(self, example, completion_ids, completion_texts, finish_reasons):
        self.calls["score_group"] += 1
        i = int(example["id"])
        ns = [len(c) for c in completion_ids]
        r = [float((i + n) % 3 == 0) for n in ns]
        return GroupScores([a + 0.25 * (n % 2) for a, n in zip(r, ns)], {"r": r, "odd": [float(n % 2) for n in ns]},
                           [n == 5 for n in ns], {"correct": [bool(a) for a in r], "n": ns})


def _groups(env, backend=None, opts=None, n_groups=6):
    tok, params = FakeTokenizer(), SamplingParams(temperature=1.0, max_tokens=7)

    async def run():
        out = []
        for i in range(n_groups):
            ex = {"id": i, "prompt": str(i), "answer": "x"}
            out.append(await generate_group(backend or SeededBackend(True), env, tok, ex, [1, 2, 3][:1 + i % 3], 8,
                                            params, f"g{i}", (5, 0, i), opts or GroupOptions()))
        return out

    return asyncio.run(run())


@pytest.mark.parametrize("arrays", [False, True])
@pytest.mark.parametrize("mask_flagged", [True, False])
def test_a_group_scored_in_one_call_is_the_group_scored_per_sample(arrays, mask_flagged):
    opts = GroupOptions(mask_flagged_samples=mask_flagged)
    env = GroupInfoEnv()
    grouped = _groups(env, SeededBackend(arrays), opts)
    assert env.calls == {"score": 0, "score_group": 6}
    off = GroupInfoEnv()
    off.score_group = None  # the instance turns it off: a score call per sample
    per_sample = _groups(off, SeededBackend(arrays), opts)
    assert off.calls == {"score": 48, "score_group": 0}
    for g, ref in zip(grouped, per_sample):
        assert type(g) is GroupSamples and type(ref) is GroupSamples and not g.built
        assert (g.rewards, g.env_mask, g.components, g.infos) == (ref.rewards, ref.env_mask, ref.components, ref.infos)
        assert any(g.env_mask) == mask_flagged or not any(n == 5 for n in g.completion_lens)
        assert g.info_columns.column("n") == g.completion_lens
        # every sample's scoring time is its share of the one call
        assert len(set(g.env_s)) == 1 and g.env_s[0] >= 0.0
        for a, b in zip(g, ref):
            _same_sample(a, b)


def test_group_scoring_is_used_only_where_it_is_the_environments_own():
    class OverridesScore(GroupInfoEnv):  # an override of score below score_group: never bypassed
        def score(self, example, completion_ids, completion_text, finish_reason):
            res = super().score(example, completion_ids, completion_text, finish_reason)
            res.reward += 1.0
            return res

    env = OverridesScore()
    assert not group_scoring(env)
    groups = _groups(env)
    assert env.calls == {"score": 48, "score_group": 0}
    assert all(r >= 1.0 for g in groups for r in g.rewards)

    assert group_scoring(GroupInfoEnv()) and not group_scoring(FakeEnv())
    assert isinstance(GroupInfoEnv(), GroupScoringEnvironment) and not isinstance(FakeEnv(), GroupScoringEnvironment)

    env = GroupInfoEnv()  # an environment deadline: each sample scored in the pool with its deadline
    _groups(env, opts=GroupOptions(env_timeout_s=30.0))
    assert env.calls == {"score": 48, "score_group": 0}

    env = GroupInfoEnv()  # a backend without a group call: a task and a score call per sample
    _groups(env, backend=SeededBackend(True, group_calls=False))
    assert env.calls == {"score": 48, "score_group": 0}


def test_a_wrong_group_score_fails_the_group_naming_the_environment():
    class Plain(GroupInfoEnv):
        def score_group(self, example, completion_ids, completion_texts, finish_reasons):
            return [self.score(example, c, t, f) for c, t, f in zip(completion_ids, completion_texts, finish_reasons)]

    with pytest.raises(TypeError, match="Plain.score_group returned list, expected rl_core.columns.GroupScores"):
        _groups(Plain(), n_groups=1)

    class Short(GroupInfoEnv):
        def score_group(self, example, completion_ids, completion_texts, finish_reasons):
            s = super().score_group(example, completion_ids, completion_texts, finish_reasons)
            s.infos["n"] = s.infos["n"][:-1]
            s.masks = s.masks + [False]
            return s

    with pytest.raises(ValueError, match=r"Short.score_group returned masks \(9\), infos\['n'\] \(7\) entries for a "
                                         r"group of 8 completions"):
        _groups(Short(), n_groups=1)
