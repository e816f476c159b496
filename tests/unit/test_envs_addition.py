"""The addition environment's scoring, the registry, and chat-template opt-in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rl_core.config.schema import AdditionEnvConfig
from rl_core.data.dataset import load_jsonl
from rl_core.envs import AdditionEnv, BaseEnv, make_env
from rl_core.errors import RecipeError
from rl_core.model.tokenizer import build_tokenizer
from rl_core.protocols import Environment

EXAMPLE = {"id": 745, "prompt": "07+45=", "answer": "250", "a": 7, "b": 45}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300)


@pytest.fixture(scope="module")
def env(tok):
    return make_env(AdditionEnvConfig(), tok)


def _score(env, tok, text, finish="stop", eos=True, decoded_eos=True):
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    shown = text + (tok.eos_token if eos and decoded_eos else "")
    return env.score(EXAMPLE, ids, shown, finish)


def test_make_env_builds_an_environment(env, tok):
    assert isinstance(env, AdditionEnv) and isinstance(env, Environment)
    assert env.name == "addition" and env.stop_strings() == ()
    assert env.end_token_ids == (tok.eos_token_id,)


def test_prompt_is_raw_text_without_special_tokens(env, tok):
    ids = env.prompt_ids(EXAMPLE)
    assert ids == tok.encode("07+45=", add_special_tokens=False)
    assert len(ids) == 6 and not set(ids) & set(tok.all_special_ids)
    assert env.reference_completion_ids(EXAMPLE) == tok.encode("250", add_special_tokens=False) + [tok.eos_token_id]


def test_exact_answer_with_end_token_scores_one(env, tok):
    r = _score(env, tok, "250")
    assert r.reward == 1.0 and r.rewards == {"correct": 1.0, "format": 0.0, "digits": 1.0}
    assert r.info["correct"] is True and r.mask is False
    # backends that decode with skip_special_tokens give the text without the end token
    assert _score(env, tok, "250", decoded_eos=False).reward == 1.0


@pytest.mark.parametrize("text, finish, eos", [
    ("251", "stop", True),  # wrong value
    ("052", "stop", True),  # plain (not reversed) order
    ("250", "length", False),  # truncated before the end token
    ("250", "stop", False),  # stopped without the end token (e.g. a stop string)
    ("2500", "stop", True),  # extra digit
    (" 250", "stop", True),  # leading space
    ("250 ", "stop", True),  # trailing space
    ("", "stop", True),  # end token only
])
def test_anything_else_scores_zero(env, tok, text, finish, eos):
    r = _score(env, tok, text, finish=finish, eos=eos)
    assert r.reward == 0.0 and r.rewards["correct"] == 0.0 and r.info["correct"] is False


def test_truncated_completion_with_end_text_but_length_reason(env, tok):
    ids = tok.encode("250", add_special_tokens=False)
    assert env.score(EXAMPLE, ids, "250", "length").reward == 0.0


def test_format_reward(tok):
    env = make_env(AdditionEnvConfig(format_reward=0.1), tok)
    right = _score(env, tok, "250")
    assert right.reward == pytest.approx(1.1) and right.rewards == {"correct": 1.0, "format": 0.1, "digits": 1.0}
    wrong_but_well_formed = _score(env, tok, "999")
    assert wrong_but_well_formed.reward == pytest.approx(0.1)
    assert wrong_but_well_formed.info == {"correct": False, "well_formed": True}
    for text, finish, eos in [("25", "stop", True), ("2500", "stop", True), ("25x", "stop", True),
                              ("250", "length", False)]:
        r = _score(env, tok, text, finish=finish, eos=eos)
        assert r.reward == 0.0 and r.info["well_formed"] is False, text


def test_digit_partial_credit(tok):
    env = make_env(AdditionEnvConfig(digit_reward=0.5), tok)
    # answer 250: "251" has 2 of 3 digits right; "052" has 1 (the middle 5); truncated earns nothing
    assert _score(env, tok, "251").rewards["digits"] == pytest.approx(2 / 3)
    assert _score(env, tok, "251").reward == pytest.approx(0.5 * 2 / 3)
    assert _score(env, tok, "052").rewards["digits"] == pytest.approx(1 / 3)
    assert _score(env, tok, "250", finish="length", eos=False).rewards["digits"] == 0.0
    assert _score(env, tok, "250").reward == pytest.approx(1.5)


def test_aborted_sample_is_masked(env, tok):
    r = env.score(EXAMPLE, tok.encode("2", add_special_tokens=False), "2", "abort")
    assert r.mask is True and r.reward == 0.0 and r.rewards == {"correct": 0.0, "format": 0.0, "digits": 0.0}


def test_unknown_finish_reason_is_an_error(env, tok):
    with pytest.raises(ValueError, match="finish_reason"):
        env.score(EXAMPLE, [tok.eos_token_id], tok.eos_token, "eos")


def test_unknown_env_type_names_the_field(tok):
    with pytest.raises(RecipeError, match="env.type"):
        make_env(SimpleNamespace(type="chess"), tok)


class _ChatAddition(AdditionEnv):
    """The same task, but prompts go through the tokenizer's chat template."""

    use_chat_template = True
    system_prompt = "Add the numbers."


def test_an_env_can_opt_into_the_chat_template(tok):
    env = _ChatAddition(AdditionEnvConfig(), tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    text = tok.decode(env.prompt_ids(EXAMPLE))
    assert text == ("<|im_start|>system\nAdd the numbers.<|im_end|>\n"
                    "<|im_start|>user\n07+45=<|im_end|>\n<|im_start|>assistant\n")
    assert env.end_token_ids[0] == im_end and tok.eos_token_id in env.end_token_ids
    assert env.reference_completion_ids(EXAMPLE)[-1] == im_end
    ids = tok.encode("250", add_special_tokens=False) + [im_end]
    assert env.score(EXAMPLE, ids, "250<|im_end|>", "stop").reward == 1.0


def test_chat_env_needs_a_template(tok):
    bare = build_tokenizer([EXAMPLE], 300)
    bare.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        _ChatAddition(AdditionEnvConfig(), bare)


def test_base_env_is_abstract(tok):
    with pytest.raises(TypeError):
        BaseEnv(AdditionEnvConfig(), tok)
