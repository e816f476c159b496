"""Multi-turn observations templated by the environment base class (rl_core.envs.base.BaseEnv):
an environment writes its observation as text (`observation_text`); `observe` feeds it raw, or,
with `use_chat_template`, as a user turn of the tokenizer's chat template. Expected strings are
written out by hand for each template, never produced by the code under test."""

from __future__ import annotations

import copy

import pytest

from rl_core.config.schema import ChainAdditionEnvConfig
from rl_core.data.dataset import load_jsonl
from rl_core.envs.chain import ChainAdditionEnv
from rl_core.model.tokenizer import build_tokenizer

EXAMPLE = {"id": 3, "prompt": "07+45=", "answer": "250", "a": 7, "b": 45}  # third operand (3 * 37 + 11) % 100 = 22


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300)  # ChatML template, eos <|endoftext|>


class ChatChain(ChainAdditionEnv):
    use_chat_template = True


def _turn(env, tok, text: str, end: str | None, finish: str = "stop"):
    ids = tok.encode(text, add_special_tokens=False) + ([tok.convert_tokens_to_ids(end)] if end else [])
    return env.parse_completion(ids, text + (end or ""), finish)


def test_raw_text_observation_is_encoded_as_it_is(tok):
    env = ChainAdditionEnv(ChainAdditionEnvConfig(), tok)
    done = _turn(env, tok, "250", "<|endoftext|>")
    assert env.observe(EXAMPLE, 0, done) == tok.encode("+22=", add_special_tokens=False)
    assert env.observe(EXAMPLE, 1, done) is None  # the last turn: the episode ends


def test_chat_observation_is_a_user_turn_after_the_policy_end_token(tok):
    env = ChatChain(ChainAdditionEnvConfig(), tok)
    ended = _turn(env, tok, "250", "<|im_end|>")
    assert ended.ended
    want = "\n<|im_start|>user\n+22=<|im_end|>\n<|im_start|>assistant\n"  # ChatML after the generated <|im_end|>
    assert env.observe(EXAMPLE, 0, ended) == tok.encode(want, add_special_tokens=False)
    # the whole conversation then reads as the template writes a two-turn chat
    convo = env.prompt_ids(EXAMPLE) + ended.ids + env.observe(EXAMPLE, 0, ended)
    assert tok.decode(convo) == ("<|im_start|>user\n07+45=<|im_end|>\n<|im_start|>assistant\n250<|im_end|>"
                                 "\n<|im_start|>user\n+22=<|im_end|>\n<|im_start|>assistant\n")
    assert env.observe(EXAMPLE, 1, ended) is None


def test_chat_observation_closes_a_turn_that_did_not_end_on_an_end_token(tok):
    env = ChatChain(ChainAdditionEnvConfig(), tok)
    cut = _turn(env, tok, "250", None)  # stopped by a stop string: no end token generated
    assert not cut.ended
    want = "<|im_end|>\n<|im_start|>user\n+22=<|im_end|>\n<|im_start|>assistant\n"
    assert env.observe(EXAMPLE, 0, cut) == tok.encode(want, add_special_tokens=False)


def test_another_template_is_followed_not_chatml(tok):
    # a Llama-3-like layout whose turns end with the tokenizer's eos string
    other = copy.deepcopy(tok)
    other.chat_template = ("{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] }}<|endoftext|>{% endfor %}"
                           "{% if add_generation_prompt %}[assistant]\n{% endif %}")
    env = ChatChain(ChainAdditionEnvConfig(), other)
    ended = _turn(env, other, "250", "<|endoftext|>")
    assert other.decode(env.observe(EXAMPLE, 0, ended)) == "[user]\n+22=<|endoftext|>[assistant]\n"
    cut = _turn(env, other, "250", None)
    assert other.decode(env.observe(EXAMPLE, 0, cut)) == "<|endoftext|>[user]\n+22=<|endoftext|>[assistant]\n"


def test_a_template_that_rewrites_history_is_refused_with_the_way_out(tok):
    last_only = copy.deepcopy(tok)
    last_only.chat_template = "{{ messages[-1]['content'] }}"  # earlier turns vanish: no prefix to extend
    env = ChatChain(ChainAdditionEnvConfig(), last_only)
    with pytest.raises(ValueError, match=r"chain_addition.*override `observe`"):
        env.observe(EXAMPLE, 0, _turn(env, last_only, "250", "<|im_end|>"))
