"""The built-in environments' group scoring (`BaseEnv.score_group` through each class's
`score_columns`): on real completions (the tiny tokenizer; ragged, right, wrong, unparsable,
truncated, with and without the end token, ids as lists and as arrays) a group scored in one
call gives exactly the rewards, components, masks and infos of a `score` call per sample, in
the same order and with the same types; where no vectorised scoring applies (an environment
without one, a subclass overriding `score_completion` or `parse_completion`) the rollout keeps
a `score` call per sample; a group with an aborted sample, and a bad finish reason, behave as
per sample."""

from __future__ import annotations

import numpy as np
import pytest

from rl_core.columns import GroupResults, GroupSamples, GroupScores
from rl_core.config.schema import AdditionEnvConfig
from rl_core.data.dataset import load_jsonl
from rl_core.envs import AdditionEnv, BaseEnv, make_env
from rl_core.model.tokenizer import build_tokenizer
from rl_core.rollout.group import group_scoring
from rl_core.types import EnvResult
from tests.unit.test_group_columns import _same_sample

EXAMPLE = {"id": 745, "prompt": "07+45=", "answer": "250", "a": 7, "b": 45}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300)


def _group(tok, env, texts, arrays):
    """A group of completions: each text's ids with the end token (most), without it (cut by
    length), a stop without the end token, and an end token kept in the decoded text."""
    ids, shown, fins = [], [], []
    end = env.end_token_ids[0]
    for i, text in enumerate(texts):
        kind = i % 5
        body = tok.encode(text, add_special_tokens=False)
        c = body + ([end] if kind in (0, 1, 3) else [])
        ids.append(np.array(c, dtype=np.int64) if arrays else c)
        # kind 3: the decoder kept the end token's text (stripped by parse_completion)
        shown.append(text + (tok.convert_ids_to_tokens(end) * (1 + i % 2) if kind == 3 else ""))
        fins.append("length" if kind == 2 else "stop")  # kind 4: stopped on a stop string, no end token
    return ids, shown, fins


def _assert_same(env, example, ids, texts, fins, mask_flagged=True, score_group=None):
    """score_group's columns (`env.score_group`, or `score_group(env, ...)`), and the
    GroupSamples built from them, equal the per-sample scores."""
    per_sample = [env.score(example, c, t, f) for c, t, f in zip(ids, texts, fins)]
    grouped = (score_group or type(env).score_group)(env, example, ids, texts, fins)
    assert type(grouped) is GroupScores
    grouped.check(len(ids), "score_group")
    assert grouped.rewards == [r.reward for r in per_sample]
    assert list(map(type, grouped.rewards)) == [type(r.reward) for r in per_sample]
    assert grouped.columns("components").rows() == [r.rewards for r in per_sample]
    assert grouped.columns("infos").rows() == [r.info for r in per_sample]
    for a, b in zip(grouped.columns("infos").rows() + grouped.columns("components").rows(),
                    [r.info for r in per_sample] + [r.rewards for r in per_sample]):
        assert list(a) == list(b) and [type(v) for v in a.values()] == [type(v) for v in b.values()]
    n = len(ids)
    results = GroupResults(ids, [[-0.5] * len(c) for c in ids], fins, [3] * n, [3] * n)
    a = GroupSamples([1, 2], results, texts, grouped, 0.0, [0.0] * n, mask_flagged)
    b = GroupSamples([1, 2], results, texts, per_sample, 0.0, [0.0] * n, mask_flagged)
    assert (a.rewards, a.env_mask, a.components, a.infos) == (b.rewards, b.env_mask, b.components, b.infos)
    for x, y in zip(a, b):
        _same_sample(x, y)
    return grouped


ADDITION_TEXTS = ["250", "251", "25", "2500", "abc", "", " 250", "250", "\uff12\uff15\uff10", "052", "250", "2+5",
                  "250\n", "99", "250", "25"]


@pytest.mark.parametrize("arrays", [False, True])
@pytest.mark.parametrize("cfg", [{}, {"format_reward": 0.1}, {"format_reward": 0.2, "digit_reward": 0.5}])
def test_addition_group_scores_are_the_per_sample_scores(tok, cfg, arrays):
    env = make_env(AdditionEnvConfig(**cfg), tok)
    assert group_scoring(env)
    ids, texts, fins = _group(tok, env, ADDITION_TEXTS, arrays)
    g = _assert_same(env, EXAMPLE, ids, texts, fins)
    assert g.masks is None and 1.0 in g.components["correct"] and 0.0 in g.components["correct"]
    for ex in ({"id": 1, "prompt": "00+00=", "answer": "000"}, {"id": 2, "prompt": "x", "answer": ""}):
        _assert_same(env, ex, ids, texts, fins)


MATH_TEXTS = {
    "boxed": ["so \\boxed{7}", "\\boxed{7.0}", "\\boxed{8}", "\\boxed{\\frac{14}{2}}", "no box 7", "\\boxed{7",
              "\\boxed{}", "\\boxed{8}", "\\boxed{7}", "", "\\fbox{7}", "\\boxed{x^{2}}"],
    "hash": ["3 + 4\n#### 7", "#### 7.0", "#### 8", "7", "#### \n", "#### 1,000", "#### 7"],
    "last_number": ["3 + 4 = 7", "it is 8", "seven", "7.0", "1,000 or 7", ""],
    "number_only": ["7", " 7 ", "7.", "3 + 4 = 7", "+7", "8", ""],
}


@pytest.mark.parametrize("arrays", [False, True])
@pytest.mark.parametrize("fmt", sorted(MATH_TEXTS))
def test_math_group_scores_are_the_per_sample_scores_with_one_check_per_answer(tok, fmt, arrays, monkeypatch):
    pytest.importorskip("math_verify", reason="env.type math needs math-verify (the `tasks` extra)")
    import rl_core.envs.math as math_env
    from rl_core.config.model_sections import MathEnvConfig

    env = make_env(MathEnvConfig(answer_format=fmt, use_chat_template=False, format_reward=0.25), tok)
    assert group_scoring(env)
    ex = {"prompt": "What is 3 + 4?", "answer": "She adds.\n#### 7"}
    ids, texts, fins = _group(tok, env, MATH_TEXTS[fmt] * 2, arrays)
    g = _assert_same(env, ex, ids, texts, fins)
    assert g.components["correct"].count(1.0) >= 1

    checked = []
    real = math_env.answers_match
    monkeypatch.setattr(math_env, "answers_match", lambda gold, answer: checked.append(answer) or real(gold, answer))
    g = env.score_group(ex, ids, texts, fins)
    parsed = {(env.parse_completion(c, t, f).text, env.parse_completion(c, t, f).ended) for c, t, f in
              zip(ids, texts, fins)}
    answers = [env.extract(t) for t, e in parsed if e]
    assert sorted(checked, key=str) == sorted([a for a in answers if a is not None], key=str)  # once per distinct text
    assert len(checked) < g.infos["well_formed"].count(True)


@pytest.mark.parametrize("answer_format", ["answer_tag", "last_line"])
def test_reasoning_gym_group_scores_are_the_per_sample_scores(tok, answer_format):
    pytest.importorskip("reasoning_gym")
    from rl_core.config.model_sections import ReasoningGymEnvConfig
    from rl_core.data.reasoning_gym import reasoning_gym_examples

    cfg = {"min_terms": 2, "max_terms": 2, "max_digits": 1}
    env = make_env(ReasoningGymEnvConfig(task="basic_arithmetic", config=cfg, answer_format=answer_format,
                                         format_reward=0.1), tok)
    assert group_scoring(env)
    ex = reasoning_gym_examples("basic_arithmetic", cfg, 4, 2, seed=3)[1][0]
    right, wrong = ex["answer"], str(int(ex["answer"]) + 1)
    texts = [f"<answer>{right}</answer>", f"<answer>{wrong}</answer>", right, f"work\n{right}\n", "", "<answer></answer>",
             f"<answer> {right} </answer> <answer>{wrong}", f"<answer>{right}</answer>", "x\n\n", f"{wrong}\n"]
    ids, shown, fins = _group(tok, env, texts * 2, arrays=True)
    g = _assert_same(env, ex, ids, shown, fins)
    assert 0.0 in g.components["correct"] and 1.0 in g.components["correct"]


def test_a_group_with_an_aborted_sample_is_scored_as_per_sample(tok):
    env = make_env(AdditionEnvConfig(format_reward=0.1), tok)
    ids, texts, fins = _group(tok, env, ADDITION_TEXTS[:8], arrays=True)
    fins[3] = "abort"
    g = _assert_same(env, EXAMPLE, ids, texts, fins)
    assert g.masks == [i == 3 for i in range(8)] and g.columns("infos").rows()[3] == {"aborted": True}
    n = len(ids)
    a = GroupSamples([1], GroupResults(ids, [[0.0] * len(c) for c in ids], fins, [0] * n, [0] * n), texts, g, 0.0,
                     [0.0] * n, False)
    assert a.env_mask == [False] * n  # masks count only with mask_flagged_samples, as per sample


def test_a_bad_finish_reason_fails_as_per_sample(tok):
    env = make_env(AdditionEnvConfig(), tok)
    ids, texts, fins = _group(tok, env, ["250", "1"], arrays=False)
    for call in (lambda: env.score_group(EXAMPLE, ids, texts, ["stop", "eos"]),
                 lambda: env.score(EXAMPLE, ids[1], texts[1], "eos")):
        with pytest.raises(ValueError, match=r"finish_reason must be one of \('stop', 'length', 'abort'\), got 'eos'"):
            call()


def test_group_scoring_only_where_a_vectorised_scoring_is_the_classs_own(tok, tmp_path, monkeypatch):
    from rl_core.config.model_sections import ChainAdditionEnvConfig, RewardFunctionsEnvConfig

    class Scaled(AdditionEnv):  # overrides score_completion: AdditionEnv's columns would bypass it
        def score_completion(self, example, completion):
            res = super().score_completion(example, completion)
            return EnvResult(2 * res.reward, res.rewards, res.mask, res.info)

    class Parsed(AdditionEnv):  # overrides parse_completion: likewise
        def parse_completion(self, completion_ids, completion_text, finish_reason):
            return super().parse_completion(completion_ids, completion_text.strip(), finish_reason)

    class UserEnv(BaseEnv):  # a user's environment without columns of its own
        def score_completion(self, example, completion):
            return EnvResult(float(completion.text == example["answer"]))

    class UserColumns(UserEnv):  # ... and one with them
        def score_columns(self, example, texts, ended, finish_reasons):
            return GroupScores([float(t == example["answer"]) for t in texts])

    (tmp_path / "grp_rewards_mod.py").write_text("def exact(prompt, completion, example):\n"
                                                 "    return float(completion == example['answer'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = AdditionEnvConfig()
    off = [Scaled(cfg, tok), Parsed(cfg, tok), UserEnv(cfg, tok), make_env(ChainAdditionEnvConfig(max_turns=1), tok),
           make_env(RewardFunctionsEnvConfig(functions=[{"target": "grp_rewards_mod:exact"}]), tok)]
    for env in off:
        assert not group_scoring(env), type(env).__name__
        assert env.score_group is None  # the rollout scores each sample: a loop over score measured no faster
    user = UserColumns(cfg, tok)
    assert group_scoring(user) and group_scoring(make_env(cfg, tok))
    ids, texts, fins = _group(tok, user, ADDITION_TEXTS, arrays=True)
    _assert_same(user, EXAMPLE, ids, texts, fins)

    # BaseEnv.score_group called where its columns do not apply: a score call per sample, Scaled's rewards
    g = _assert_same(off[0], EXAMPLE, ids, texts, fins, score_group=BaseEnv.score_group)
    assert max(g.rewards) == 2.0


def test_group_scores_of_dicts_that_differ_per_sample_check_their_length():
    rows = GroupScores.of_results([EnvResult(1.0, {"a": 1.0}, False, {"x": 1}), EnvResult(0.0, {}, True, {})])
    rows.check(2, "Env.score_group")
    assert rows.masks == [False, True] and rows.columns("infos").rows() == [{"x": 1}, {}]
    rows.infos = rows.infos[:1]
    with pytest.raises(ValueError, match=r"Env.score_group returned infos \(1\) entries for a group of 2"):
        rows.check(2, "Env.score_group")
