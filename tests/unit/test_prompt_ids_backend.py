"""A batch's prompt ids from the Rust backend's `encode_batch_fast` (`envs.base.backend_prompt_ids`,
used by `BaseEnv.prompt_ids_many`; issue 18 item 3, docs/controller.md "What we learned"):
the ids must equal transformers' batch call and each text's `encode`, and every backend setting
transformers' call would change first (truncation, padding, special-token splitting) or a
prompt it would warn about must leave the batch to transformers' call."""

from __future__ import annotations

import copy

import pytest

from rl_core.config.schema import AdditionEnvConfig
from rl_core.data.addition import all_examples
from rl_core.data.dataset import load_jsonl
from rl_core.envs import make_env
from rl_core.envs.base import backend_prompt_ids
from rl_core.model.tokenizer import SPECIAL_TOKENS, build_tokenizer

TRICKY = ["", " ", "  07+45=", "\n\n", "\t x \r\n y ", "Größe – 数字 ✓ 07+45=", "a" * 3000,
          "12+34=" * 200, "\ufffd\x00", "'s 're 'll ' ve"]
TRICKY += [f"x {t} y{t}" for t in SPECIAL_TOKENS] + list(SPECIAL_TOKENS)


@pytest.fixture()
def tok():
    return build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300)


def _texts() -> list[str]:
    pairs = all_examples()
    return [pairs[(i * 37) % len(pairs)]["prompt"] for i in range(400)] + TRICKY


def _call(tok, texts):
    return tok(texts, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False)["input_ids"]


def test_backend_ids_equal_the_transformers_call_and_each_encode(tok):
    texts = _texts()
    got = backend_prompt_ids(tok, texts)
    assert got is not None
    assert got == _call(tok, texts) == [tok.encode(t, add_special_tokens=False) for t in texts]
    assert all(type(ids) is list and all(type(i) is int for i in ids) for ids in got)
    assert got[0] is not got[1]  # a fresh list per text
    env = make_env(AdditionEnvConfig(), tok)  # the environment's batch encode takes this path
    assert env._encode_texts(texts) == got


def test_backend_settings_transformers_would_change_leave_the_batch_to_it(tok):
    texts = _texts()
    want = _call(tok, texts)
    for setup in (lambda t: t.backend_tokenizer.enable_truncation(4),
                  lambda t: t.backend_tokenizer.enable_padding(length=8),
                  lambda t: setattr(t, "split_special_tokens", True)):
        t = copy.deepcopy(tok)
        setup(t)
        assert backend_prompt_ids(t, texts) is None
        env = make_env(AdditionEnvConfig(), t)
        assert env._encode_texts(texts) == _call(t, texts)  # transformers' own result, whatever it is
    assert _call(tok, texts) == want


def test_long_prompts_empty_batches_and_non_strings_are_left_to_transformers(tok):
    t = copy.deepcopy(tok)
    t.model_max_length = 100
    assert backend_prompt_ids(t, ["12+34=" * 200]) is None  # transformers logs a too-long warning for it
    assert backend_prompt_ids(t, ["12+34="]) == _call(t, ["12+34="])
    assert backend_prompt_ids(tok, []) is None
    assert backend_prompt_ids(tok, ["12+34=", ("a", "b")]) is None
    assert backend_prompt_ids(object(), ["12+34="]) is None  # no Rust backend
