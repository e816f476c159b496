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
    env = object.__new__(_EndsWith)  # no tokenizer: the two attributes parse_completion reads
    env.end_token_ids, env._end_strings = (3,), ("<end>",)
    for ids in ([5, 7, 3], [5, 7], []):
        a = env.parse_completion(np.asarray(ids, dtype=np.int64), "x<end>", "stop")
        b = env.parse_completion(list(ids), "x<end>", "stop")
        assert a == b and all(type(i) is int for i in a.ids) and a.text == "x"
    assert env.parse_completion(np.asarray([5, 3], dtype=np.int64), "", "stop").ended
