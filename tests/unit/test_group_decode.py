"""A group call's completions are decoded off the event loop (`rollout.decode.decode_group`,
issue 18 item 3): one Rust `decode_batch` on a decode thread where the tokenizer is an
unmodified transformers tokenizer over `tokenizers.Tokenizer` without clean-up, else one
`decode` per completion on the loop. The texts must be byte-identical to
`tokenizer.decode(ids, skip_special_tokens=True)`, errors must propagate, and every other
tokenizer must keep today's path."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from rl_core.columns import GroupResults
from rl_core.data.dataset import load_jsonl
from rl_core.model.tokenizer import SPECIAL_TOKENS, build_tokenizer, wrap_tokenizer
from rl_core.rollout import decode as decode_mod
from rl_core.rollout.decode import decode_group, group_decoder
from rl_core.rollout.group import GroupOptions, generate_group
from rl_core.types import SamplingParams
from tests.helpers.fakes import FakeEnv, FakeTokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300)


def ragged_completions(tok) -> list[list[int]]:
    """Completions of 0..~300 tokens: digits, prose, non-ASCII text whose bytes span tokens
    (cut in the middle of a character too), the special tokens inside and at the end (EOS once
    or twice), a single special token, ids of every kind the vocabulary has."""
    eos = tok.eos_token_id
    specials = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    text = tok.encode("so 07 + 45 = 52, reversed 250. Größe – 数字 ✓ ", add_special_tokens=False)
    long = (text * 12)[:297]
    out = [[], [eos], [eos, eos], specials, text, text + [eos], text[:7], text[:-3] + [eos],
           long, long[:255] + [eos], long[:131] + specials + long[:40] + [eos, eos],
           list(range(len(tok))), tok.encode("250", add_special_tokens=False) + [eos]]
    out += [long[: 200 + i] + ([eos] if i % 2 else []) for i in range(8)]  # cut anywhere, also mid-character
    return out


def test_the_tiny_tokenizer_gets_the_batch_decoder(tok):
    assert tok.clean_up_tokenization_spaces is False
    assert group_decoder(tok) is not None


@pytest.mark.parametrize("kind", ["lists", "int64", "int32", "readonly"])
def test_batch_texts_are_byte_identical_to_decode(tok, kind):
    ids = ragged_completions(tok)
    if kind != "lists":
        ids = [np.array(t, dtype=np.int32 if kind == "int32" else np.int64) for t in ids]
        if kind == "readonly":
            for a in ids:
                a.flags.writeable = False
    want = [tok.decode(t, skip_special_tokens=True) for t in ids]
    got = group_decoder(tok)(ids)
    assert got == want
    assert [g.encode() for g in got] == [w.encode() for w in want]  # bytes, not just equal strings
    assert any("\ufffd" in w for w in want) and any(w == "" for w in want)  # the hard cases are in
    assert asyncio.run(decode_group(tok, ids)) == want


class CountingPool(ThreadPoolExecutor):
    def __init__(self):
        super().__init__(max_workers=1, thread_name_prefix="test-decode")
        self.threads: list[str] = []

    def submit(self, fn, *args, **kwargs):
        def run():
            self.threads.append(threading.current_thread().name)
            return fn(*args, **kwargs)
        return super().submit(run)


class TokenBackend:
    """A group call answering the given completions (lists or arrays) as columns."""

    def __init__(self, completions):
        self.completions, self.version = completions, 0

    async def generate(self, request):  # pragma: no cover - the group call is used
        raise AssertionError("generate called")

    async def generate_group(self, key, prompt_ids, params, seeds):
        ids = self.completions[:len(seeds)]
        return GroupResults(list(ids), [np.zeros(len(t), np.float32) for t in ids], ["stop"] * len(ids),
                            [0] * len(ids), [0] * len(ids))


def run_group(backend, tokenizer, n):
    return asyncio.run(generate_group(backend, FakeEnv(), tokenizer, {"id": 3}, [1, 2, 3], n,
                                      SamplingParams(max_tokens=400), "g", (0, 3), GroupOptions()))


@pytest.mark.parametrize("arrays", [False, True])
def test_a_group_call_decodes_on_a_decode_thread_the_same_texts(tok, monkeypatch, arrays):
    pool = CountingPool()
    monkeypatch.setattr(decode_mod, "_DECODE_POOL", pool)
    ids = ragged_completions(tok)[:16]
    if arrays:
        ids = [np.array(t, dtype=np.int64) for t in ids]
    group = run_group(TokenBackend(ids), tok, len(ids))
    assert [s.info["text"] for s in group] == [tok.decode(t, skip_special_tokens=True) for t in ids]
    assert pool.threads == ["test-decode_0"]  # one batch call per group, on the pool's thread
    pool.shutdown()


class OwnDecode(PreTrainedTokenizerFast):
    """A subclass with its own `decode` (it must be called, not bypassed)."""

    def decode(self, token_ids, skip_special_tokens=False, **kwargs):
        return "own:" + super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)


def test_other_tokenizers_decode_on_the_loop_as_before(tok, monkeypatch):
    pool = CountingPool()
    monkeypatch.setattr(decode_mod, "_DECODE_POOL", pool)
    ids = ragged_completions(tok)[:16]
    assert group_decoder(FakeTokenizer()) is None  # no Rust backend
    fake_group = run_group(TokenBackend(ids), FakeTokenizer(), 16)
    assert [s.info["text"] for s in fake_group] == [FakeTokenizer().decode(t, skip_special_tokens=True) for t in ids]
    own = wrap_tokenizer(tok.backend_tokenizer)
    own.__class__ = OwnDecode
    assert group_decoder(own) is None
    assert [s.info["text"] for s in run_group(TokenBackend(ids), own, 16)] == [
        "own:" + tok.decode(t, skip_special_tokens=True) for t in ids]
    cleaning = wrap_tokenizer(tok.backend_tokenizer)
    cleaning.clean_up_tokenization_spaces = True  # a Python step after the Rust decode: not reproduced
    assert group_decoder(cleaning) is None
    assert pool.threads == []


@pytest.mark.parametrize("bad", [[5, -1, 6], [5, 2**40]])
def test_a_decode_error_fails_the_group_as_decode_would(tok, bad):
    with pytest.raises(OverflowError) as want:
        tok.decode(bad, skip_special_tokens=True)
    ids = ragged_completions(tok)[:3] + [bad]
    with pytest.raises(OverflowError) as got:
        run_group(TokenBackend(ids), tok, 4)
    assert str(got.value) == str(want.value)


def test_the_tokenizer_a_run_reloads_gets_the_batch_decoder_with_the_same_texts(tok, tmp_path):
    """A run loads its tokenizer back from the policy directory (`AutoTokenizer`: transformers'
    Qwen2Tokenizer class here, as for Qwen models): the same texts through the batch decoder."""
    from transformers import AutoTokenizer

    import json

    tok.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"  # what a run's policy directory names
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert type(loaded).__name__ == "Qwen2Tokenizer" and group_decoder(loaded) is not None
    ids = ragged_completions(tok)
    assert group_decoder(loaded)(ids) == [loaded.decode(t, skip_special_tokens=True) for t in ids]
