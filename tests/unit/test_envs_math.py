"""env.type math: answer extraction per format, math-verify checks on known right and wrong
answers, the reward components, templating options and the recipe-load checks."""

from __future__ import annotations

import importlib.util

import pytest
from pydantic import ValidationError

pytest.importorskip("math_verify", reason="env.type math needs math-verify (the `tasks` extra)")

from rl_core.config.model_sections import MathEnvConfig  # noqa: E402
from rl_core.data.dataset import load_jsonl  # noqa: E402
from rl_core.envs import MathEnv, make_env  # noqa: E402
from rl_core.envs.math import (answers_match, extract_boxed, extract_hash, extract_last_number,  # noqa: E402
                               extract_number_only, gold_answer)
from rl_core.errors import RecipeError  # noqa: E402
from rl_core.model.tokenizer import build_tokenizer  # noqa: E402
from rl_core.protocols import Environment  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300)


def _env(tok, **kw):
    return make_env(MathEnvConfig(**kw), tok)


def _score(env, tok, text, example, finish="stop", ended=True):
    end = env.end_token_ids[0]
    ids = tok.encode(text, add_special_tokens=False) + ([end] if ended else [])
    shown = text + (tok.convert_ids_to_tokens(end) if ended else "")
    return env.score(example, ids, shown, finish if ended else "length")


@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\fbox{7}", "7"),
    ("\\boxed{x^{2}+1}", "x^{2}+1"),
    ("\\boxed{3", None),          # never closed
    ("\\boxed{}", None),          # empty
    ("42", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_hash_last_number_and_number_only():
    assert extract_hash("48/2 = 24\n#### 72") == "72"
    assert extract_hash("#### 5\n#### 6 apples\nmore") == "6 apples"
    assert extract_hash("#### \n") is None and extract_hash("72") is None
    assert extract_last_number("3 + 4 = 7, not 8.5 or 1,000") == "1,000"
    assert extract_last_number("no digits") is None
    assert extract_number_only(" 12\n") == "12" and extract_number_only("-3.5") == "-3.5"
    assert extract_number_only("3 + 4 = 7") is None and extract_number_only("7.") is None
    assert extract_number_only("") is None


def test_gold_answer_reduces_gsm8k_and_boxed_answers():
    assert gold_answer("She sells 16 - 3 - 4 = 9 eggs.\n#### 18") == "18"
    assert gold_answer("\\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    assert gold_answer(" 7 ") == "7"


@pytest.mark.parametrize("gold, answer, ok", [
    ("7", "7", True),
    ("7", "7.0", True),
    ("1000", "1,000", True),
    ("0.5", "\\frac{1}{2}", True),
    ("\\frac{1}{2}", "1/2", True),
    ("7", "+7", True),
    ("7", "8", False),
    ("72", "27", False),
    ("0.5", "\\frac{1}{3}", False),
    ("7", "seven hundred", False),
])
def test_answers_match_known_right_and_wrong(gold, answer, ok):
    assert answers_match(gold, answer) is ok


def test_math_env_is_an_environment_with_two_components(tok):
    env = _env(tok, use_chat_template=False)
    assert isinstance(env, MathEnv) and isinstance(env, Environment)
    assert env.name == "math" and env.reward_names == ("correct", "format")


def test_boxed_scoring_right_wrong_unformatted_truncated(tok):
    env = _env(tok, use_chat_template=False, format_reward=0.25)
    ex = {"prompt": "What is 3 + 4?", "answer": "7"}
    right = _score(env, tok, "3 + 4 = \\boxed{7}", ex)
    assert right.reward == 1.25 and right.rewards == {"correct": 1.0, "format": 1.0}
    assert right.info["correct"] is True and right.info["answer"] == "7"
    wrong = _score(env, tok, "\\boxed{8}", ex)
    assert wrong.reward == 0.25 and wrong.rewards == {"correct": 0.0, "format": 1.0}
    unformatted = _score(env, tok, "The answer is 7", ex)
    assert unformatted.reward == 0.0 and unformatted.info["correct"] is False
    truncated = _score(env, tok, "\\boxed{7}", ex, ended=False)
    assert truncated.reward == 0.0 and truncated.rewards == {"correct": 0.0, "format": 0.0}


def test_hash_format_against_a_gsm8k_gold(tok):
    env = _env(tok, use_chat_template=False, answer_format="hash")
    ex = {"prompt": "Eggs?", "answer": "16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18"}
    assert _score(env, tok, "9 * 2 = 18\n#### 18", ex).reward == 1.0
    assert _score(env, tok, "#### 18.00", ex).reward == 1.0
    assert _score(env, tok, "#### 19", ex).reward == 0.0
    assert _score(env, tok, "18", ex).reward == 0.0
    assert tok.decode(env.reference_completion_ids(ex)[:-1]) == "#### 18"


def test_number_only_is_strict_and_last_number_is_lenient(tok):
    ex = {"prompt": "What is 3 + 4?", "answer": "7"}
    strict = _env(tok, use_chat_template=False, answer_format="number_only", format_reward=0.5)
    assert _score(strict, tok, "7", ex).rewards == {"correct": 1.0, "format": 1.0}
    assert _score(strict, tok, "3 + 4 = 7", ex).rewards == {"correct": 0.0, "format": 0.0}
    assert _score(strict, tok, "9", ex).reward == 0.5
    lenient = _env(tok, use_chat_template=False, answer_format="last_number")
    assert _score(lenient, tok, "3 + 4 = 7", ex).reward == 1.0
    assert _score(lenient, tok, "3 + 4 = 7, or 8", ex).reward == 0.0


def test_chat_template_system_prompt_and_instruction(tok):
    env = _env(tok, system_prompt="Be brief.", instruction="Put the answer in \\boxed{}.")
    ex = {"prompt": "What is 3 + 4?", "answer": "7"}
    text = tok.decode(env.prompt_ids(ex))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 3 + 4? Put the answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    assert env.end_token_ids[0] == tok.convert_tokens_to_ids("<|im_end|>")
    assert _score(env, tok, "\\boxed{7}", ex).reward == 1.0
    raw = _env(tok, use_chat_template=False)
    assert tok.decode(raw.prompt_ids(ex)) == "What is 3 + 4?"


def test_config_rejects_unknown_format_and_system_prompt_without_template():
    with pytest.raises(ValidationError):
        MathEnvConfig(answer_format="latex")
    with pytest.raises((RecipeError, ValidationError), match="env.system_prompt"):
        MathEnvConfig(use_chat_template=False, system_prompt="hi")


def test_missing_math_verify_is_a_recipe_error_at_load(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises((RecipeError, ValidationError), match="math-verify"):
        MathEnvConfig()
