"""What counts as a correct sample (issue 39): each built-in environment's verdict
(`info["correct"]`, what accuracy, pass@k and the best checkpoint count) where its reward
has a shaping term, so that reward > 0 would say otherwise; the recipe's `env.success` for
reward functions and agents, and its refusal at recipe load; the verdict in the rollout
spool, the archive and the validation record's per-component means."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rl_core.config import validate_dict
from rl_core.config.schema import (AdditionEnvConfig, ChainAdditionEnvConfig, ReasoningGymEnvConfig,
                                   RewardFunctionsEnvConfig, SuccessCriterion)
from rl_core.data.dataset import load_jsonl
from rl_core.envs import make_env
from rl_core.envs.base import BaseEnv
from rl_core.errors import RecipeError
from rl_core.model.tokenizer import build_tokenizer
from rl_core.rollout.group import is_correct
from rl_core.types import EnvResult, PromptGroup, Sample
from tests.helpers.fakes import FakeChatTokenizer
from tests.helpers.user_code import user_module

REWARDS = '''
def right(prompt, completion, example):
    return completion == example["answer"]

def two_digits(prompt, completion, example):
    return len(completion) == 2 and completion.isdigit()

def penalty(prompt, completion, example):
    return float(completion != example["answer"])
'''
EX = {"prompt": "07+45=", "answer": "250", "a": 7, "b": 45, "id": 3}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300)


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    with user_module(tmp_path, monkeypatch, "success_rewards_mod", REWARDS) as name:
        yield name


def _score(env, tok, example, text, ended=True):
    end = env.end_token_ids[0]
    ids = tok.encode(text, add_special_tokens=False) + ([end] if ended else [])
    return env.score(example, ids, text, "stop" if ended else "length")


def _sample(result: EnvResult) -> Sample:
    return Sample([1], [2], [-0.5], result.reward, "stop", 0, 0, dict(result.rewards), False, dict(result.info))


def _verdicts(result: EnvResult) -> tuple[float, bool]:
    """(reward, whether the sample counts as correct)."""
    return result.reward, is_correct(_sample(result))


# --------------------------------------------------------------------------- the criterion and the recipe


def test_the_criterion_tests_a_component_or_the_total():
    assert SuccessCriterion(component="c").passes(5.0, {"c": 0.0}) is False
    assert SuccessCriterion(component="c").passes(0.0, {"c": 0.5}) is True
    assert SuccessCriterion(threshold=1.0).passes(1.0, {}) is True
    assert SuccessCriterion(threshold=1.0).passes(0.999, {"c": 2.0}) is False
    assert SuccessCriterion(component="c", threshold=0.9).passes(0.0, {"c": 0.9}) is True
    with pytest.raises(ValueError, match=r"env.success.*a `component`, a `threshold` or both"):
        SuccessCriterion()  # (pydantic wraps it; a recipe load reports the RecipeError itself)


def _rf_recipe(functions, **env):
    return validate_dict({"env": {"type": "reward_functions", "functions": functions, **env}})


def test_reward_functions_with_a_shaping_term_need_a_criterion():
    functions = [{"target": "m:right", "name": "correct"}, {"target": "m:two_digits", "weight": 0.1}]
    with pytest.raises(RecipeError) as err:
        _rf_recipe(functions)
    text = str(err.value)
    for words in ("field `env.success` got (missing)", "more than one function (correct, two_digits)",
                  "reward > 0 would count a shaping bonus", "success: {component: correct}", "{threshold: 1.0}"):
        assert words in text, (words, text)
    with pytest.raises(RecipeError, match=r"`env.success.component` got 'corect'.*env.functions: correct, two_digits"):
        _rf_recipe(functions, success={"component": "corect"})
    cfg = _rf_recipe(functions, success={"component": "correct"})
    assert cfg.env.criterion() == SuccessCriterion(component="correct")
    # one function: its value > 0, by default
    assert _rf_recipe(functions[:1]).env.criterion() == SuccessCriterion(component="correct")
    assert _rf_recipe([{"target": "m:right"}]).env.criterion() == SuccessCriterion(component="right")


def test_agent_criterion_names_a_declared_component():
    base = {"type": "agent", "target": "m:agent", "reward_names": ["a", "b"]}
    with pytest.raises(RecipeError, match=r"env.success.component.*env.reward_names: a, b"):
        validate_dict({"env": {**base, "success": {"component": "c"}}})
    with pytest.raises(RecipeError, match=r"env.success.component.*env.reward_names: none"):
        validate_dict({"env": {"type": "http", "url": "http://127.0.0.1:9", "success": {"component": "a"}}})
    assert validate_dict({"env": base}).env.success is None  # optional: components need not be shaping terms


# --------------------------------------------------------------------------- each environment's verdict


def test_reward_functions_count_the_named_component(rewards_module, tok):
    fns = [{"target": f"{rewards_module}:right", "name": "correct"},
           {"target": f"{rewards_module}:two_digits", "weight": 0.1}]
    env = make_env(RewardFunctionsEnvConfig(functions=fns, success={"component": "correct"}), tok)
    assert _verdicts(_score(env, tok, EX, "250")) == (1.0, True)
    bonus = _score(env, tok, EX, "25")
    assert bonus.reward == pytest.approx(0.1) and bonus.info["correct"] is False and not is_correct(_sample(bonus))
    # a threshold on the total: the right answer alone reaches it, the bonus alone does not
    env = make_env(RewardFunctionsEnvConfig(functions=fns, success={"threshold": 1.0}), tok)
    assert _verdicts(_score(env, tok, EX, "250"))[1] and not _verdicts(_score(env, tok, EX, "25"))[1]


def test_one_reward_function_counts_its_own_value(rewards_module, tok):
    """One function and no criterion: its value > 0 (not the weighted total: a negative weight
    makes a right sample's reward negative)."""
    env = make_env(RewardFunctionsEnvConfig(functions=[{"target": f"{rewards_module}:penalty", "weight": -1.0}]), tok)
    wrong = _score(env, tok, EX, "251")
    assert wrong.reward == -1.0 and wrong.info["correct"] is True
    assert _verdicts(_score(env, tok, EX, "250")) == (0.0, False)


def test_addition_bonuses_are_never_correct(tok):
    env = make_env(AdditionEnvConfig(format_reward=0.5, digit_reward=0.5), tok)
    reward, ok = _verdicts(_score(env, tok, EX, "251"))  # well formed, two of three digits right
    assert reward == pytest.approx(0.5 + 0.5 * 2 / 3) and not ok
    assert _verdicts(_score(env, tok, EX, "250")) == (pytest.approx(2.0), True)
    texts = ["250", "251", "25"]  # the group scoring gives the same verdicts
    ids = [tok.encode(t, add_special_tokens=False) + [env.end_token_ids[0]] for t in texts]
    scores = env.score_group(EX, ids, texts, ["stop"] * 3)
    assert scores.infos["correct"] == [True, False, False] and all(r > 0 for r in scores.rewards[:2])


def test_chain_addition_counts_every_turn(tok):
    env = make_env(ChainAdditionEnvConfig(), tok)
    right1 = env.parse_completion(tok.encode("250", add_special_tokens=False) + [env.end_token_ids[0]], "250", "stop")
    wrong2 = env.parse_completion(tok.encode("000", add_special_tokens=False) + [env.end_token_ids[0]], "000", "stop")
    assert _verdicts(env.score_turns(EX, [right1, wrong2])) == (0.5, False)


def test_math_format_reward_is_not_correct(tok):
    pytest.importorskip("math_verify", reason="env.type math needs math-verify (the `tasks` extra)")
    from rl_core.config.model_sections import MathEnvConfig

    env = make_env(MathEnvConfig(format_reward=0.25, use_chat_template=False), tok)
    ex = {"prompt": "3+4?", "answer": "7"}
    assert _verdicts(_score(env, tok, ex, "\\boxed{8}")) == (0.25, False)
    assert _verdicts(_score(env, tok, ex, "\\boxed{7}")) == (1.25, True)


def test_reasoning_gym_partial_credit_is_not_correct(tok):
    pytest.importorskip("reasoning_gym")
    env = make_env(ReasoningGymEnvConfig(task="basic_arithmetic", format_reward=0.1), tok)
    ex = {"prompt": "Calculate 2 + 3.", "answer": "5", "metadata": {}}
    assert _verdicts(_score(env, tok, ex, "<answer>6</answer>")) == (pytest.approx(0.1), False)
    assert _verdicts(_score(env, tok, ex, "<answer>5</answer>")) == (pytest.approx(1.1), True)


def test_agent_results_follow_the_criterion(tmp_path, monkeypatch):
    from rl_core.envs.agent import AgentEnv, AgentError, HttpServiceEnv

    with user_module(tmp_path, monkeypatch, "success_agent_mod", "async def agent(client, example):\n    return 1.0\n"):
        cfg = validate_dict({"env": {"type": "agent", "target": "success_agent_mod:agent",
                                     "reward_names": ["solved", "tidy"], "success": {"component": "solved"}}}).env
        env = AgentEnv(cfg, FakeChatTokenizer())
    assert _verdicts(env.to_result({"solved": 0.0, "tidy": 1.0})) == (1.0, False)
    assert _verdicts(env.to_result({"solved": 1.0, "tidy": 0.0})) == (1.0, True)
    # an EnvResult the agent built: the recipe's criterion decides
    assert not env.to_result(EnvResult(0.5, {"solved": 0.0}, info={"correct": True})).info["correct"]
    with pytest.raises(AgentError, match=r"no reward component 'solved', which env.success.component names"):
        env.to_result(EnvResult(0.5, {"tidy": 1.0}))
    # no criterion: the agent's own verdict where it gives one, else reward > 0
    service = HttpServiceEnv(validate_dict({"env": {"type": "http", "url": "http://127.0.0.1:9"}}).env,
                             FakeChatTokenizer())
    assert _verdicts(service.to_result(0.2)) == (0.2, True)
    assert _verdicts(service.to_result(EnvResult(0.2, info={"correct": False}))) == (0.2, False)
    assert _verdicts(service.to_result({"x": 0.0})) == (0.0, False)


def test_custom_classes_declare_their_verdict(tok):
    from examples.custom_env.my_env import CloseEnoughEnv

    cfg = validate_dict({"env": {"type": "custom", "target": "examples.custom_env.my_env:CloseEnoughEnv",
                                 "kwargs": {"tolerance": 2, "near_reward": 0.3}}}).env
    env = CloseEnoughEnv(cfg, tok)
    assert _verdicts(_score(env, tok, EX, "150")) == (0.3, False)  # 51 is within 2 of 52: near, not right

    class NoVerdict(BaseEnv):  # no info["correct"]: reward > 0 counts
        def score_completion(self, example, completion):
            return EnvResult(reward=float(completion.text == example["answer"]) + 0.1)

    assert _verdicts(_score(NoVerdict(cfg, tok), tok, EX, "999")) == (pytest.approx(0.1), True)


# --------------------------------------------------------------------------- where the verdict goes


def test_spool_and_archive_keep_the_verdict(tmp_path):
    from rl_core.archive import RolloutArchive, compile_spool
    from rl_core.rollout.spool import RolloutSpool

    # rewards > 0 everywhere (a bonus), two samples of four right, and a component named
    # `correct` that disagrees: the archive's accuracy is the environment's verdict
    infos = [{"correct": True}, {"correct": False}, {}, {"correct": True}]
    rewards = [1.1, 0.1, 0.0, 1.1]
    samples = [Sample([1], [2, 3], [-0.1, -0.2], r, "stop", 0, 0, {"correct": 0.0, "bonus": 1.0}, False, dict(i))
               for r, i in zip(rewards, infos)]
    group = PromptGroup("g0", 0, 0, dict(EX), samples, 0, 0, 0)
    spool = RolloutSpool(tmp_path / "spool")
    spool.write(1, 0, [SimpleNamespace(group=group, advantages=[0.0] * 4, staleness=0)])
    record = json.loads((tmp_path / "spool" / "step_000001.json").read_text())
    assert [s["correct"] for s in record["groups"][0]["samples"]] == [True, False, False, True]
    compile_spool(tmp_path / "spool", tmp_path / "rollouts.h5")
    with RolloutArchive(tmp_path / "rollouts.h5") as ar:
        assert ar.summary()["accuracy"] == 0.5
        assert [ar.sample(i)["correct"] for i in range(4)] == [True, False, False, True]


def test_validation_reports_each_component_mean():
    from rl_core.rollout.validation import component_means

    samples = [Sample([1], [2], [-0.1], 1.1, "stop", 0, 0, {"correct": c, "bonus": 1.0}) for c in (1.0, 0.0, 0.0)]
    samples.append(Sample([1], [2], [-0.1], 0.0, "abort", 0, 0, {"correct": 0.0}))
    assert component_means(samples) == {"correct": 0.25, "bonus": 1.0}
