"""Lockstep NativeBackend (reproducible runs): the engine's batches follow the event loop, so
a slow loop (a loaded machine) cannot change which requests share a step, and the results
are bitwise the same whatever the timing. A free-running backend is shown to be timing-
dependent under the same slow loop, so the test can fail."""

from __future__ import annotations

import asyncio
import time

from rl_core.generation.native.backend import NativeBackend
from rl_core.types import GenerationRequest, SamplingParams

from tests.helpers.engine_models import make_engine, prompts, tiny_model


def _requests(tag: str) -> list[GenerationRequest]:
    params = [SamplingParams(temperature=1.0, max_tokens=6 + i % 3, seed=100 + i) for i in range(6)]
    return [GenerationRequest(f"{tag}{i}", p, params[i]) for i, p in enumerate(prompts(6, seed=3, lengths=(3, 12)))]


def _run(lockstep: bool, delays: list[float]) -> tuple[list, list[int]]:
    """Six requests submitted by tasks that block the loop for `delays[i]` seconds first (as a
    busy machine would), then later ones after a few yields; returns results and step sizes."""
    backend = NativeBackend(make_engine(tiny_model(), max_batch_size=8), lockstep=lockstep)

    async def go():
        await backend.start()

        async def one(i: int, req: GenerationRequest):
            for _ in range(i):
                await asyncio.sleep(0)
            time.sleep(delays[i])  # the loop is slow: a free-running worker steps meanwhile
            return await backend.generate(req)

        try:
            return await asyncio.gather(*(one(i, r) for i, r in enumerate(_requests("r"))))
        finally:
            await backend.shutdown()

    results = asyncio.run(go())
    rows = [rec.num_rows for rec in backend.step_trace()]
    return [(r.token_ids, r.logprobs) for r in results], rows


def test_lockstep_batches_do_not_depend_on_timing():
    fast, fast_rows = _run(True, [0.0] * 6)
    slow, slow_rows = _run(True, [0.03, 0.0, 0.05, 0.0, 0.02, 0.04])
    assert fast_rows[0] == 6 and fast_rows == slow_rows  # every request in the first step, both times
    assert fast == slow  # bitwise: tokens and logprobs


def test_free_running_backend_depends_on_timing():
    _, rows = _run(False, [0.03, 0.0, 0.05, 0.0, 0.02, 0.04])
    assert rows[0] < 6  # the worker stepped before the slow loop had submitted everything


def test_lockstep_backend_shuts_down_and_serves_weight_updates():
    backend = NativeBackend(make_engine(tiny_model(), max_batch_size=4), lockstep=True)
    model = tiny_model(seed=1)

    async def go():
        await backend.start()
        await backend.update_weights(3, model.state_dict())
        res = await backend.generate(GenerationRequest("x", prompts(1)[0], SamplingParams(greedy=True, max_tokens=4)))
        await backend.shutdown()
        return res

    res = asyncio.run(go())
    assert backend.weight_version == 3 and len(res.token_ids) == 4


def test_lockstep_shutdown_does_not_need_the_driver():
    """At interpreter exit (a preempted job) the loop may cancel the driver before the backend's
    shutdown runs: the worker must still stop, or joining it would hang the process."""
    backend = NativeBackend(make_engine(tiny_model(), max_batch_size=4), lockstep=True)

    async def go():
        await backend.start()
        await backend.generate(GenerationRequest("x", prompts(1)[0], SamplingParams(greedy=True, max_tokens=3)))
        backend._driver.cancel()
        await asyncio.wait_for(backend.shutdown(), timeout=30)

    asyncio.run(go())
    assert not backend._thread.is_alive()
