"""Prompt ids looked up for a text encoded before (`envs.prompt_ids_cache.PromptIdsCache`, used by
`BaseEnv.prompt_ids_many`; issue 18 item 3, eleventh round): the ids must be what the uncached
batch encode gives, every example a list of its own, the bounds held, a tokenizer with added
tokens encoding afresh, and an encode error propagating with nothing held."""

from __future__ import annotations

import copy

import pytest

from rl_core.config.schema import AdditionEnvConfig
from rl_core.data.dataset import load_jsonl
from rl_core.envs import make_env
from rl_core.envs.prompt_ids_cache import PromptIdsCache
from rl_core.model.tokenizer import build_tokenizer
from tests.unit.test_prompt_ids_many import _examples


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300)


def _uncached(env, exs):
    return env._encode_texts([env.prompt_text(e) for e in exs])


def test_cached_ids_are_the_uncached_encodes_ids_in_every_pass(tok):
    env = make_env(AdditionEnvConfig(), tok)
    exs = _examples()
    want = _uncached(env, exs)
    assert want == [env.prompt_ids(e) for e in exs]
    first = env.prompt_ids_many(exs)
    cache = env._prompt_ids_cache
    again = env.prompt_ids_many(exs[::-1])
    assert first == want and again == want[::-1]
    assert cache.hits >= len(exs) and cache.misses == len({env.prompt_text(e) for e in exs})
    for got in (first, again):
        assert all(type(ids) is list and all(type(i) is int for i in ids) for ids in got)
    first[0].append(-1)  # a caller's list is its own: the next lookup is unharmed
    again[-1].append(-2)
    assert env.prompt_ids_many(exs[:1]) == want[:1]


def test_a_text_twice_in_a_batch_gets_two_equal_lists(tok):
    env = make_env(AdditionEnvConfig(), tok)
    exs = _examples()[:3]
    batch = [exs[0], exs[1], exs[0], exs[2], exs[0]]
    want = _uncached(env, batch)
    for _ in range(2):  # encoded, then looked up
        got = env.prompt_ids_many(batch)
        assert got == want
        assert len({id(ids) for ids in got}) == len(got)


@pytest.mark.parametrize("max_ids,max_prompts", [(40, 1000), (10_000, 5), (1, 1), (0, 0)])
def test_the_bounds_hold_and_the_ids_stay_exact(tok, max_ids, max_prompts):
    env = make_env(AdditionEnvConfig(), tok)
    env._prompt_ids_cache = cache = PromptIdsCache(max_ids=max_ids, max_prompts=max_prompts)
    exs = _examples()
    want = _uncached(env, exs)
    for start in range(0, len(exs), 37):
        assert env.prompt_ids_many(exs[start:start + 50]) == want[start:start + 50]
        assert cache.held_ids <= max_ids and len(cache._ids) <= max_prompts
        assert cache.held_ids == sum(map(len, cache._ids.values()))
    assert env.prompt_ids_many(exs) == want


def test_added_tokens_empty_the_cache(tok):
    grown = copy.deepcopy(tok)
    env = make_env(AdditionEnvConfig(), grown)
    exs = [{"id": 0, "prompt": "07+45=", "answer": "0"}, {"id": 1, "prompt": "zz 07+45=", "answer": "0"}]
    before = env.prompt_ids_many(exs)
    grown.add_tokens(["07+45"])
    after = env.prompt_ids_many(exs)
    assert after == _uncached(env, exs) and after != before


def test_an_encode_error_propagates_and_nothing_is_held(tok):
    cache = PromptIdsCache()

    def broken(texts):
        raise RuntimeError("tokenizer down")

    with pytest.raises(RuntimeError, match="tokenizer down"):
        cache.encode_many(tok, ["07+45=", "12+34="], broken)
    assert cache._ids == {} and cache.held_ids == 0
    env = make_env(AdditionEnvConfig(), tok)
    assert cache.encode_many(tok, ["07+45="], env._encode_texts) == [env.prompt_ids({"prompt": "07+45="})]
