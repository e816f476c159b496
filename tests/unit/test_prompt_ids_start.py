"""A drawn batch's prompt ids begun when it is drawn and waited for when its first group starts
(`BaseEnv.start_prompt_ids_many`, the rollout pump's `BatchPrompts`; issue 18 item 3,
docs/controller.md "What we learned"): the ids must be `prompt_ids_many`'s (and each
`prompt_ids`), the Rust encode must run on the encode thread, the cache must stay exact with
batches in flight together, and every failure must leave the groups to encode their own."""

from __future__ import annotations

import copy
import threading

import pytest

from rl_core.config.schema import AdditionEnvConfig
from rl_core.controller.rollout_pump import BatchPrompts
from rl_core.data.addition import all_examples
from rl_core.data.dataset import load_jsonl
from rl_core.envs import base, make_env
from rl_core.model.tokenizer import SPECIAL_TOKENS, build_tokenizer

TRICKY = ["", " ", "  07+45=", "\n\n", "Größe – 数字 ✓ 07+45=", "a" * 3000, "12+34=" * 200, "'s 're 'll ' ve"]
TRICKY += [f"x {t} y{t}" for t in SPECIAL_TOKENS]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300)


def _examples(start: int = 0, n: int = 300) -> list[dict]:
    pairs = all_examples()
    exs = [dict(pairs[(i * 37) % len(pairs)], id=i) for i in range(start, start + n)]
    return exs + [{"id": 5000 + i, "prompt": t, "answer": "0"} for i, t in enumerate(TRICKY)]


def _held_consistent(env) -> None:
    cache = env._prompt_ids_cache
    assert cache.held_ids == sum(map(len, cache._ids.values()))


def test_a_started_batch_gives_prompt_ids_many_and_encodes_on_the_encode_thread(tok, monkeypatch):
    env, plain = make_env(AdditionEnvConfig(), tok), make_env(AdditionEnvConfig(), tok)
    threads = []
    backend_ids = base.backend_prompt_ids

    def recording(tokenizer, texts):
        threads.append(threading.current_thread().name)
        return backend_ids(tokenizer, texts)

    monkeypatch.setattr(base, "backend_prompt_ids", recording)
    exs = _examples()
    for _ in range(2):  # a first pass encodes, a second looks every text up
        got = env.start_prompt_ids_many(exs)()
        assert got == plain.prompt_ids_many(exs) == [plain.prompt_ids(e) for e in exs]
        assert all(type(ids) is list and all(type(i) is int for i in ids) for ids in got)
    assert threads[0].startswith("rl_core-encode")  # the first pass's encode; the second's texts were held
    assert env.start_prompt_ids_many([])() == []
    _held_consistent(env)


def test_batches_in_flight_together_stay_exact(tok):
    env = make_env(AdditionEnvConfig(), tok)
    first, second = _examples(0, 200), _examples(100, 200)  # overlapping texts, neither held yet
    a, b = env.start_prompt_ids_many(first), env.start_prompt_ids_many(second)
    got_b, got_a = b(), a()  # finished in the other order
    assert got_a == [env.prompt_ids(e) for e in first] and got_b == [env.prompt_ids(e) for e in second]
    _held_consistent(env)
    assert env.start_prompt_ids_many(first)() == got_a
    small = make_env(AdditionEnvConfig(), tok)  # bounds hit with batches in flight
    small._prompt_ids_cache = base.PromptIdsCache(max_ids=50, max_prompts=7)
    a, b = small.start_prompt_ids_many(first), small.start_prompt_ids_many(second)
    assert (a(), b()) == (got_a, got_b)
    cache = small._prompt_ids_cache
    assert cache.held_ids <= 50 and len(cache._ids) <= 7
    _held_consistent(small)


def test_failures_and_other_classes(tok):
    exs = _examples(0, 20)
    broken = copy.deepcopy(tok)

    class Boom(RuntimeError):
        pass

    def fail(*a, **k):
        raise Boom

    env = make_env(AdditionEnvConfig(), broken)
    object.__setattr__(broken, "_tokenizer", _Failing(broken._tokenizer, fail))
    result = env.start_prompt_ids_many(exs)
    with pytest.raises(Boom):
        result()
    assert not env._prompt_ids_cache._ids  # nothing held from the failed encode

    class OwnBatch(type(make_env(AdditionEnvConfig(), tok))):
        def prompt_ids_many(self, examples):
            return [[len(e["prompt"])] for e in examples]

    assert OwnBatch(AdditionEnvConfig(), tok).start_prompt_ids_many(exs)() == [[len(e["prompt"])] for e in exs]
    chat = make_env(AdditionEnvConfig(), tok)
    chat.use_chat_template = True
    assert chat.start_prompt_ids_many(exs)() is None
    padded = copy.deepcopy(tok)
    padded.backend_tokenizer.enable_padding(length=12)  # transformers' call on the loop, as prompt_ids_many
    env = make_env(AdditionEnvConfig(), padded)
    assert env.start_prompt_ids_many(exs)() == make_env(AdditionEnvConfig(), padded).prompt_ids_many(exs)


class _Failing:
    """A Rust backend whose `encode_batch_fast` raises (everything else passed through)."""

    def __init__(self, inner, fail):
        self._inner, self.encode_batch_fast = inner, fail

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_batch_prompts_wait_only_for_their_own_groups():
    calls = []

    def result():
        calls.append(1)
        return [[1], [2], [3]]

    keys = [(0, 5), (0, 6), (0, 7)]
    batch = BatchPrompts(keys, result)
    assert batch.pop((0, 1)) is None and calls == []  # another batch's group: not waited for
    assert batch.pop((0, 6)) == [2] and calls == [1]
    assert batch.pop((0, 6)) is None and batch.pop((0, 5)) == [1] and calls == [1]  # resolved once, popped once
    assert batch.pop((0, 1), "x") == "x"

    def broken():
        raise ValueError("bad prompt")

    for bad in (broken, lambda: None, lambda: [[1], [2]]):  # fails, refused, or the wrong count: none
        b = BatchPrompts(keys, bad)
        assert [b.pop(k) for k in keys] == [None, None, None]
    assert BatchPrompts.of(keys, [[1], [2], [3]]) == dict(zip(keys, [[1], [2], [3]]))
    assert BatchPrompts.of(keys, None) == {} and BatchPrompts.of(keys, [[1]]) == {}
