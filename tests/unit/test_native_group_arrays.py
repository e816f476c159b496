"""NativeBackend(group_arrays=True): `generate_many` hands token ids and logprobs over as NumPy
arrays with the values `generate` hands over as lists; an environment scores them alike."""

from __future__ import annotations

import asyncio

import numpy as np

from rl_core.envs.base import BaseEnv
from rl_core.generation import NativeBackend
from rl_core.types import GenerationRequest, SamplingParams
from tests.unit.test_generation_backend import make_engine, prompts, run_async, tiny_model


def test_generate_many_hands_arrays_of_the_values_generate_hands_as_lists():
    model = tiny_model()
    ps = prompts(5, seed=7)
    requests = [GenerationRequest(f"s{i}", p, SamplingParams(temperature=0.9, max_tokens=6, seed=200 + i))
                for i, p in enumerate(ps)]

    async def main():
        out = []
        for group_arrays in (True, False):
            backend = NativeBackend(make_engine(model), lockstep=True, group_arrays=group_arrays)
            await backend.start()
            out.append((await backend.generate_many(requests),
                        await asyncio.gather(*(backend.generate(GenerationRequest(f"g{r.request_id}", r.prompt_ids,
                                                                                  r.params)) for r in requests))))
            await backend.shutdown()
        return out

    (arrays, one), (lists, _) = run_async(main())
    for a, b, c in zip(arrays, one, lists):
        assert isinstance(a.token_ids, np.ndarray) and a.token_ids.dtype == np.int64 and a.token_ids.ndim == 1
        assert isinstance(a.logprobs, np.ndarray) and a.logprobs.dtype == np.float32
        assert isinstance(b.token_ids, list) and isinstance(c.token_ids, list)  # generate, and the flag off: lists
        assert a.token_ids.tolist() == b.token_ids == c.token_ids and len(b.token_ids) > 0
        assert a.logprobs.tolist() == b.logprobs == c.logprobs  # float32 values: exact either way
        assert a.finish_reason == b.finish_reason and a.token_versions == b.token_versions


class _EndsWith(BaseEnv):
    def score_completion(self, example, completion):
        return completion.ended


def test_an_environment_parses_an_array_of_ids_as_the_list():
    env = object.__new__(_EndsWith)  # no tokenizer: the attributes parse_completion reads
    env.end_token_ids, env._end_strings, env._end_suffixes = (3,), ("<end>",), ("<end>",)
    for ids in ([5, 7, 3], [5, 7], []):
        a = env.parse_completion(np.asarray(ids, dtype=np.int64), "x<end>", "stop")
        b = env.parse_completion(list(ids), "x<end>", "stop")
        assert a == b and all(type(i) is int for i in a.ids) and a.text == "x"
    assert env.parse_completion(np.asarray([5, 3], dtype=np.int64), "", "stop").ended


def test_generate_group_hands_the_columns_of_one_generate_per_sample():
    from dataclasses import replace

    from rl_core.columns import GroupResults

    model = tiny_model()
    prompt = prompts(1, seed=11)[0]
    params = SamplingParams(temperature=0.9, max_tokens=6)
    seeds = [301, 7, 301, 12345]  # a repeated seed: the same completion twice

    async def main():
        out = []
        for group_arrays in (True, False):
            backend = NativeBackend(make_engine(model), lockstep=True, group_arrays=group_arrays)
            await backend.start()
            cols = await backend.generate_group("k", prompt, params, seeds)
            one = await asyncio.gather(*(backend.generate(GenerationRequest(f"k/{i}", prompt, replace(params, seed=s)))
                                         for i, s in enumerate(seeds)))  # batched alike: the same logprobs
            added = backend.engine.stats.requests_added
            await backend.shutdown()
            out.append((cols, one, added))
        return out

    for (cols, one, added), group_arrays in zip(run_async(main()), (True, False)):
        assert type(cols) is GroupResults and len(cols) == len(seeds) == len(one) and added == 2 * len(seeds)
        assert params.seed is None  # the caller's params are never modified
        for i, r in enumerate(one):
            ids, lps = cols.token_ids[i], cols.logprobs[i]
            assert isinstance(ids, np.ndarray) == group_arrays and isinstance(lps, np.ndarray) == group_arrays
            assert list(map(int, ids)) == r.token_ids and len(r.token_ids) > 0
            assert list(map(float, lps)) == r.logprobs
            assert (cols.finish_reasons[i], cols.start_versions[i], cols.end_versions[i]) == \
                (r.finish_reason, r.start_version, r.end_version)
            tv = None if cols.token_versions is None else cols.token_versions[i]
            assert tv == r.token_versions
            assert (cols.worker if cols.workers is None else cols.workers[i]) == r.worker
        assert list(cols.token_ids[0]) == list(cols.token_ids[2])
        if group_arrays:  # the group's ids and logprobs: one array each, every sample's a view of it
            for column in (cols.token_ids, cols.logprobs):
                base = column[0].base
                assert base is not None and all(a.base is base for a in column)
                assert base.size == sum(map(len, column))


def test_generate_group_cancelled_or_refused_aborts_the_groups_requests():
    """Cancelled: every sample is aborted in the engine. A sample the engine refuses (here its
    request id is already in flight) fails the call, and the samples added before it are aborted;
    the other request with that id is left alone."""
    import pytest

    from tests.unit.test_generation_backend import greedy, wait_until

    model = tiny_model()
    prompt = prompts(1, seed=5)[0]

    async def main():
        engine = make_engine(model, step_delay_s=0.005)
        backend = NativeBackend(engine, group_arrays=True)
        await backend.start()
        task = asyncio.create_task(backend.generate_group("c", prompt, greedy(50), [1, 2, 3]))
        await wait_until(lambda: engine.num_running == 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: engine.num_running == 0)
        cancelled = backend.metrics()["requests_aborted"]
        other = asyncio.create_task(backend.generate(GenerationRequest("r/2", prompt, greedy(30))))
        await wait_until(lambda: engine.num_running == 1)
        with pytest.raises(ValueError, match="already in the engine"):
            await backend.generate_group("r", prompt, greedy(30), [1, 2, 3, 4])
        refused = backend.metrics()
        kept = await other
        await backend.shutdown()
        return cancelled, refused, kept

    cancelled, refused, kept = run_async(main())
    assert cancelled == 3
    assert refused["requests_aborted"] == 3 + 2 and refused["requests_added"] == 3 + 1 + 2  # r/0, r/1 aborted
    assert kept.finish_reason == "length" and len(kept.token_ids) == 30  # the in-flight r/2 ran to its end
