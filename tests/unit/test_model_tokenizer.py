"""The byte-level BPE tokenizer: digits, special tokens, template, determinism."""

from __future__ import annotations

import json
import random

import pytest

from rl_core.data.dataset import load_jsonl
from rl_core.model.tokenizer import (CHAT_TEMPLATE, GENERIC_CORPUS, SPECIAL_TOKENS, build_tokenizer,
                                     digits_are_single_tokens, train_bpe)


@pytest.fixture(scope="module")
def train():
    return load_jsonl("data/addition/train.jsonl")


@pytest.fixture(scope="module")
def tok(train):
    return build_tokenizer(train, 300, model_max_length=64)


def test_every_digit_is_always_one_token(tok):
    assert digits_are_single_tokens(tok)
    digit_ids = [tok.convert_tokens_to_ids(d) for d in "0123456789"]
    assert len(set(digit_ids)) == 10
    rng = random.Random(0)
    pieces = ["the", " ", "+", "=", "\n", "x", ".", "is ", "07", "2024", " 9"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        text += str(rng.randint(0, 10**8))
        ids = tok.encode(text, add_special_tokens=False)
        assert [i for i in ids if i in digit_ids] == [digit_ids[int(c)] for c in text if c.isdigit()], text
    for n in range(1000):
        s = f"{n:03d}"
        assert tok.encode(s, add_special_tokens=False) == [digit_ids[int(c)] for c in s]


def test_task_strings_tokenize_per_character(tok):
    ids = tok.encode("07+45=250", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == list("07+45=250")


def test_special_tokens_eos_pad_and_no_bos(tok):
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.pad_token_id == 0
    assert tok.bos_token is None
    assert tok.encode("07+45=") == tok.encode("07+45=", add_special_tokens=False)  # nothing is added
    ids = tok.encode("250<|endoftext|>", add_special_tokens=False)
    assert ids[-1] == 0 and len(ids) == 4
    assert tok.decode(ids, skip_special_tokens=True) == "250"


def test_vocabulary_is_byte_level_and_has_merges(tok):
    assert 259 < len(tok) <= 300
    vocab = tok.get_vocab()
    assert "Ġthe" in vocab  # a merge learned from the generic corpus
    for text in GENERIC_CORPUS + ("naïve café — 東京 \t tabs\n", "<|im_start|>user\nhi<|im_end|>\n"):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chat_template(tok):
    assert tok.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "07+45="}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|im_start|>user\n07+45=<|im_end|>\n<|im_start|>assistant\n"


def test_training_is_deterministic(train, tok):
    again = build_tokenizer(train, 300, model_max_length=64)
    assert again.get_vocab() == tok.get_vocab()
    assert json.loads(again.backend_tokenizer.to_str())["model"]["merges"] == \
        json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


def test_vocab_size_is_a_target(train):
    small = build_tokenizer(train[:100], 270)
    assert len(small) == 270
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(["abc"], 258)
