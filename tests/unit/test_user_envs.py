"""User tasks without touching the library: data formats and field mapping, reward functions,
custom environment classes, and the reasoning-gym task's scorer (issue 15)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from rl_core.config.schema import CustomEnvConfig, ReasoningGymEnvConfig, RewardFunctionsEnvConfig
from rl_core.data.dataset import Fields, count_examples, count_rows, load_examples, load_jsonl
from rl_core.envs import make_env
from rl_core.errors import DataError, RecipeError
from rl_core.model.tokenizer import build_tokenizer
from rl_core.protocols import Environment
from rl_core.resilience import FailureKind, classify
from tests.helpers.user_code import user_module

ROWS = [{"question": f"{a}+{b}=", "solution": str(a + b), "level": a % 3} for a, b in [(1, 2), (3, 4), (5, 6)]]
CHATS = [{"chat": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{a}+1=?"}],
          "answer": str(a + 1)} for a in range(3)]
MAPPED = Fields(prompt_key="question", answer_key="solution")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300)


# --------------------------------------------------------------------------- data formats


def _write(tmp_path, rows, fmt, name="data"):
    if fmt == "jsonl":
        p = tmp_path / f"{name}.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        p = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), p)
    else:
        import datasets

        p = tmp_path / f"{name}_dir"
        datasets.Dataset.from_list(rows).save_to_disk(str(p))
    return p


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "save_to_disk"])
def test_every_format_loads_with_mapped_fields(tmp_path, fmt):
    p = _write(tmp_path, ROWS, fmt)
    examples = load_examples(p, MAPPED)
    assert [e["prompt"] for e in examples] == [r["question"] for r in ROWS]
    assert [e["answer"] for e in examples] == [r["solution"] for r in ROWS]
    assert [e["level"] for e in examples] == [1, 0, 2]  # other columns reach the environment
    assert examples[0]["question"] == "1+2="  # the original column stays
    assert count_examples(p, MAPPED) == count_rows(p) == 3


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "save_to_disk"])
def test_chat_prompts_load_with_messages_key(tmp_path, fmt):
    p = _write(tmp_path, CHATS, fmt)
    examples = load_examples(p, Fields(messages_key="chat"))
    assert examples[2]["messages"] == CHATS[2]["chat"] and examples[2]["answer"] == "3"
    assert "prompt" not in examples[0]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "save_to_disk"])
def test_malformed_rows_name_file_and_row(tmp_path, fmt):
    rows = ROWS[:2] + [{"question": None, "solution": "3", "level": 1}]
    p = _write(tmp_path, rows, fmt)
    where = "line 3" if fmt == "jsonl" else "row 3"
    with pytest.raises(DataError, match=rf"{p.name}, {where}: field 'question' got null \(null\); expected a string"):
        load_examples(p, MAPPED)
    first = "line 1" if fmt == "jsonl" else "row 1"
    with pytest.raises(DataError, match=rf"{p.name}, {first}: missing key\(s\) 'answer'"):
        load_examples(p, Fields(prompt_key="question"))


def test_bad_chats_name_row_and_message(tmp_path):
    bad = CHATS[:1] + [{"chat": [{"role": "robot", "content": "x"}], "answer": "1"}]
    p = _write(tmp_path, bad, "parquet")
    with pytest.raises(DataError, match=r"row 2: field 'chat', message 0: .*'role'"):
        load_examples(p, Fields(messages_key="chat"))
    p = _write(tmp_path, [{"chat": "hello", "answer": "1"}], "jsonl", "str")
    with pytest.raises(DataError, match=r"line 1: field 'chat' got a string; expected a non-empty list"):
        load_examples(p, Fields(messages_key="chat"))


def test_not_a_dataset_directory_and_dataset_dict(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not one written by datasets.Dataset.save_to_disk"):
        load_examples(tmp_path / "plain")
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"DatasetDict \(splits: train\).*dd/train"):
        load_examples(tmp_path / "dd", MAPPED)


def test_not_parquet(tmp_path):
    p = tmp_path / "fake.parquet"
    p.write_text('{"prompt": "1", "answer": "1"}\n')
    with pytest.raises(DataError, match="fake.parquet: not a readable Parquet file"):
        load_examples(p)


def test_default_jsonl_examples_are_unchanged():
    """The default mapping reads the addition files exactly as before (same dicts)."""
    assert load_examples("data/addition/val.jsonl") == load_jsonl("data/addition/val.jsonl")


# --------------------------------------------------------------------------- reward functions

REWARDS = '''
calls = []

def exact(prompt, completion, example):
    calls.append((prompt, completion, example))
    return completion == example["answer"]

def length(prompt, completion, example):
    return -0.1 * len(completion)

def broken(prompt, completion, example):
    raise KeyError("nope")

def text(prompt, completion, example):
    return "1.0"

def nan(prompt, completion, example):
    return float("nan")

def two_args(prompt, completion):
    return 0.0

value = 3
'''


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    with user_module(tmp_path, monkeypatch, "my_rewards_mod", REWARDS) as name:
        yield name


def _rf_config(*targets, **kw):
    return RewardFunctionsEnvConfig(functions=[{"target": t, "weight": w} for t, w in targets], **kw)


def _score(env, tok, example, text):
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return env.score(example, ids, text + tok.eos_token, "stop")


def test_reward_functions_weighted_sum_and_components(rewards_module, tok):
    env = make_env(_rf_config((f"{rewards_module}:exact", 1.0), (f"{rewards_module}:length", 0.5),
                              success={"component": "exact"}), tok)
    assert isinstance(env, Environment) and env.reward_names == ("exact", "length")
    ex = {"prompt": "07+45=", "answer": "250", "level": 2}
    res = _score(env, tok, ex, "250")
    assert res.rewards == {"exact": 1.0, "length": pytest.approx(-0.3)}
    assert res.reward == pytest.approx(1.0 - 0.15)
    prompt, completion, example = sys.modules[rewards_module].calls[-1]
    assert prompt == "07+45=" and completion == "250" and example["level"] == 2
    assert _score(env, tok, ex, "25").rewards["exact"] == 0.0


def test_reward_functions_get_chat_messages_with_the_template(rewards_module, tok):
    env = make_env(_rf_config((f"{rewards_module}:exact", 1.0), use_chat_template=True, system_prompt="Be brief."), tok)
    _score(env, tok, {"prompt": "07+45=", "answer": "250"}, "250")
    prompt = sys.modules[rewards_module].calls[-1][0]
    assert prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "07+45="}]
    chat = [{"role": "user", "content": "hi"}]
    _score(env, tok, {"messages": chat, "answer": "250"}, "250")
    assert sys.modules[rewards_module].calls[-1][0] == [{"role": "system", "content": "Be brief."}] + chat
    ids = env.prompt_ids({"messages": chat, "answer": "250"})
    assert tok.decode(ids).count("<|im_start|>") == 3  # system, user, and the opened assistant turn


@pytest.mark.parametrize("fn, match", [("broken", r"reward function broken \(my_rewards_mod:broken\) raised KeyError"),
                                       ("text", r"reward function text .* returned '1.0' \(str\)"),
                                       ("nan", r"reward function nan .* returned nan")])
def test_reward_function_errors_name_the_function(rewards_module, tok, fn, match):
    from rl_core.envs.reward_functions import RewardFunctionError

    env = make_env(_rf_config((f"{rewards_module}:{fn}", 1.0)), tok)
    with pytest.raises(RewardFunctionError, match=match) as info:
        _score(env, tok, {"prompt": "1", "answer": "1"}, "1")
    assert classify(info.value) is FailureKind.DATA  # an environment error: the data budget of the resilience policy


@pytest.mark.parametrize("fn, match", [("two_args", "fn\\(prompt, completion, example\\)"), ("value", "a function"),
                                       ("missing", "a name missing")])
def test_bad_reward_function_targets(rewards_module, fn, match):
    from rl_core.envs.reward_functions import load_reward_functions

    with pytest.raises(RecipeError, match=r"env.functions\[1\].target.*" + match):
        load_reward_functions(_rf_config((f"{rewards_module}:exact", 1.0), (f"{rewards_module}:{fn}", 1.0),
                                         success={"component": "exact"}).functions)


# --------------------------------------------------------------------------- custom environments

ENVS = '''
from rl_core.envs.base import BaseEnv
from rl_core.types import EnvResult

class Good(BaseEnv):
    name = "good"
    def __init__(self, config, tokenizer):
        super().__init__(config, tokenizer)
        self.bonus = config.kwargs["bonus"]
    def score_completion(self, example, completion):
        return EnvResult(reward=self.bonus + float(completion.text == example["answer"]))

class Abstract(BaseEnv):
    name = "abstract"

class NoEndTokens(Good):
    def __init__(self, config, tokenizer):
        self.bonus = 0.0

class OneArg(Good):
    def __init__(self, config):
        pass

class NotAnEnv:
    def __init__(self, config, tokenizer):
        pass
'''


@pytest.fixture
def envs_module(tmp_path, monkeypatch):
    (tmp_path / "my_envs_mod.py").write_text(ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_envs_mod"
    sys.modules.pop("my_envs_mod", None)


def test_custom_env_builds_with_kwargs(envs_module, tok):
    env = make_env(CustomEnvConfig(target=f"{envs_module}:Good", kwargs={"bonus": 0.5}), tok)
    assert isinstance(env, Environment) and env.name == "good"
    assert _score(env, tok, {"prompt": "1", "answer": "7"}, "7").reward == 1.5


@pytest.mark.parametrize("cls, match", [("Abstract", "abstract methods left: score_completion"),
                                        ("OneArg", r"constructed as OneArg\(config, tokenizer\)"),
                                        ("NotAnEnv", "missing: name, reward_names"),
                                        ("Nope", "a name Nope defined")])
def test_bad_custom_env_classes(envs_module, cls, match):
    from rl_core.envs.custom import load_env_class

    with pytest.raises(RecipeError, match=r"env.target.*" + match):
        load_env_class(f"{envs_module}:{cls}")


def test_custom_env_object_checked_once_built(envs_module, tok):
    with pytest.raises(RecipeError, match=r"env.target.*once built \(missing: end_token_ids"):
        make_env(CustomEnvConfig(target=f"{envs_module}:NoEndTokens"), tok)


def test_targets_in_the_working_directory_are_found(tmp_path, monkeypatch):
    """`rl-core` (a console script) does not put the working directory on sys.path; load_target does."""
    from rl_core.plugins import load_target

    (tmp_path / "cwd_only_mod.py").write_text("def f(prompt, completion, example):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        assert load_target("cwd_only_mod:f", field="env.functions[0].target", kind="callable")(None, "", {}) == 1.0
    finally:
        sys.modules.pop("cwd_only_mod", None)


# --------------------------------------------------------------------------- reasoning_gym


@pytest.fixture(scope="module")
def rg_examples():
    from rl_core.data.reasoning_gym import reasoning_gym_examples

    return reasoning_gym_examples("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "max_digits": 1}, 40, 10, seed=3)


def test_reasoning_gym_data_is_seeded_and_disjoint(rg_examples):
    from rl_core.data.reasoning_gym import reasoning_gym_examples

    train, val = rg_examples
    assert len(train) == 40 and len(val) == 10
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    cfg = {"min_terms": 2, "max_terms": 2, "max_digits": 1}
    assert reasoning_gym_examples("basic_arithmetic", cfg, 40, 10, seed=3) == (train, val)
    assert reasoning_gym_examples("basic_arithmetic", cfg, 20, 10, seed=3)[0] == train[:20]
    json.dumps(train)  # plain JSON rows


def test_reasoning_gym_scorer_right_and_wrong(rg_examples, tok):
    env = make_env(ReasoningGymEnvConfig(task="basic_arithmetic",
                                         config={"min_terms": 2, "max_terms": 2, "max_digits": 1}, format_reward=0.1), tok)
    ex = rg_examples[1][0]
    right, wrong = ex["answer"], str(int(ex["answer"]) + 1)
    res = _score(env, tok, ex, f"I think <answer>{wrong}</answer> no, <answer> {right} </answer>")
    assert res.rewards == {"correct": 1.0, "format": 0.1} and res.info["correct"] and res.reward == pytest.approx(1.1)
    res = _score(env, tok, ex, f"<answer>{wrong}</answer>")
    assert res.rewards["correct"] == 0.0 and not res.info["correct"] and res.rewards["format"] == 0.1
    res = _score(env, tok, ex, right)  # right number, but not in the required format
    assert res.reward == 0.0 and not res.info["well_formed"]
    assert env.prompt_text(ex).endswith("\n\nGive your final answer between <answer> and </answer>.")
    assert tok.decode(env.reference_completion_ids(ex)[:-1]) == f"<answer>{right}</answer>"


def test_reasoning_gym_last_line_format(tok):
    from rl_core.envs.reasoning_gym import extract_answer

    assert extract_answer("work\n 12 \n\n", "last_line") == "12"
    assert extract_answer("", "last_line") is None
    assert extract_answer("<answer>1</answer><answer>2", "answer_tag") == "1"
    env = make_env(ReasoningGymEnvConfig(task="basic_arithmetic", answer_format="last_line", instruction=None), tok)
    ex = {"prompt": "Calculate 2 + 3.", "answer": "5", "metadata": {}}
    assert _score(env, tok, ex, "2 + 3 is\n5").rewards["correct"] == 1.0
    assert env.prompt_text(ex) == "Calculate 2 + 3."


def test_reasoning_gym_bad_task_and_config():
    from rl_core.data.reasoning_gym import task_dataset

    with pytest.raises(RecipeError, match=r"env.task.*close: basic_arithmetic"):
        task_dataset("basic_arithmetc", {})
    with pytest.raises(RecipeError, match=r"env.config.*bogus"):
        task_dataset("basic_arithmetic", {"bogus": 1})
    with pytest.raises(RecipeError, match=r"env.config.*without seed"):
        task_dataset("basic_arithmetic", {"seed": 1})
