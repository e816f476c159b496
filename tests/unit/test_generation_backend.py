"""NativeBackend: the async GenerationBackend over a NativeEngine in a worker thread."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rl_core.generation import EngineOptions, GenerationError, NativeBackend, NativeEngine
from rl_core.protocols import GenerationBackend
from rl_core.types import GenerationRequest, SamplingParams

VOCAB = 100


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=VOCAB, intermediate_size=128, max_position_embeddings=64,
                      tie_word_embeddings=True, initializer_range=0.3)
    return Qwen2ForCausalLM(cfg).eval()


def make_engine(model, step_delay_s: float = 0.0, **kwargs) -> NativeEngine:
    """An engine whose steps can be slowed down, so a test can act while requests run."""
    kwargs.setdefault("max_batch_size", 8)
    engine = NativeEngine(model.config, model.state_dict(), EngineOptions(**kwargs))
    if step_delay_s:
        step = engine.step

        def slow_step():
            time.sleep(step_delay_s)
            return step()

        engine.step = slow_step
    return engine


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(s),), generator=g).tolist() for s in torch.randint(3, 10, (n,), generator=g)]


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(greedy=True, max_tokens=max_tokens)


def run_async(coro, timeout_s: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def wait_until(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


def test_many_concurrent_generates_match_the_engine():
    model = tiny_model()
    reqs = [GenerationRequest(str(i), p, greedy(2 + i % 7)) for i, p in enumerate(prompts(40))]
    reference = make_engine(model, max_batch_size=40)
    for r in reqs:
        reference.add_request(r)
    expected = {}
    while reference.has_work():
        expected.update({r.request_id: r.token_ids for r in reference.step()})

    async def main():
        backend = NativeBackend(make_engine(model, max_batch_size=16))
        assert isinstance(backend, GenerationBackend)
        assert backend.capacity() == 16
        await backend.start()
        results = await asyncio.gather(*(backend.generate(r) for r in reqs))
        metrics = backend.metrics()
        await backend.shutdown()
        return results, metrics

    results, metrics = run_async(main())
    assert {r.request_id: r.token_ids for r in results} == expected
    assert all(r.finish_reason == "length" and r.finished_at >= r.started_at for r in results)
    assert metrics["requests_finished"] == 40
    assert metrics["tokens_generated"] == sum(len(t) for t in expected.values())
    assert metrics["steps"] > 0 and metrics["busy_s"] > 0 and metrics["running"] == 0


def test_abort_of_an_in_flight_request_frees_its_slot():
    model = tiny_model()
    p = prompts(1)[0]

    async def main():
        engine = make_engine(model, step_delay_s=0.005, max_batch_size=1)
        backend = NativeBackend(engine)
        await backend.start()
        long = asyncio.create_task(backend.generate(GenerationRequest("long", p, greedy(50))))
        queued = asyncio.create_task(backend.generate(GenerationRequest("queued", p, greedy(3))))
        await wait_until(lambda: backend.metrics()["tokens_generated"] >= 3)
        await backend.abort("long")
        aborted = await long
        done = await queued  # got the freed slot
        await backend.abort("unknown-id")  # a no-op
        await backend.shutdown()
        return aborted, done

    aborted, done = run_async(main())
    assert aborted.finish_reason == "abort" and 3 <= len(aborted.token_ids) < 50
    assert len(aborted.logprobs) == len(aborted.token_ids)
    assert done.finish_reason == "length" and done.token_ids == aborted.token_ids[:3]


def test_update_weights_while_requests_run(tmp_path):
    old, new, newer = tiny_model(0), tiny_model(1), tiny_model(2)
    newer.save_pretrained(tmp_path)
    ps = prompts(4)

    async def main():
        backend = NativeBackend(make_engine(old, step_delay_s=0.005))
        await backend.start()
        tasks = [asyncio.create_task(backend.generate(GenerationRequest(str(i), p, greedy(30))))
                 for i, p in enumerate(ps)]
        await wait_until(lambda: backend.metrics()["tokens_generated"] >= 8)
        await backend.update_weights(1, new.state_dict())
        assert backend.weight_version == 1
        await backend.invalidate_kv_cache()
        spanning = await asyncio.gather(*tasks)
        await backend.update_weights(2, tmp_path)  # a directory of safetensors
        fresh = await backend.generate(GenerationRequest("fresh", ps[0], greedy(6)))
        metrics = backend.metrics()
        await backend.shutdown()
        return spanning, fresh, metrics

    spanning, fresh, metrics = run_async(main())
    for res in spanning:
        v = res.token_versions
        assert v == sorted(v) and v[0] == 0 and v[-1] == 1, v
        assert (res.start_version, res.end_version) == (0, 1)
    want = newer.generate(torch.tensor([ps[0]]), do_sample=False, max_new_tokens=6, min_new_tokens=6,
                          pad_token_id=0, eos_token_id=None)[0, len(ps[0]):].tolist()
    assert fresh.token_ids == want and fresh.token_versions == [2] * 6
    assert metrics["weight_updates"] == 2 and metrics["kv_invalidations"] == 1 and metrics["weight_version"] == 2


def test_errors_reach_the_caller_and_the_worker_keeps_serving():
    model = tiny_model()
    p = prompts(1)[0]

    async def main():
        engine = make_engine(model, max_seq_len=32)
        backend = NativeBackend(engine)
        await backend.start()
        with pytest.raises(ValueError, match="max_seq_len"):
            await backend.generate(GenerationRequest("too-long", list(range(40)), greedy()))
        with pytest.raises(ValueError, match="shape"):
            await backend.update_weights(1, {"model.norm.weight": torch.zeros(3)})
        assert backend.weight_version == 0

        def boom(*args, **kwargs):
            raise RuntimeError("boom")

        engine.model.forward = boom  # the next step raises inside the worker thread
        with pytest.raises(GenerationError) as info:
            await asyncio.gather(*(backend.generate(GenerationRequest(f"x{i}", p, greedy())) for i in range(3)))
        assert isinstance(info.value.__cause__, RuntimeError) and "boom" in str(info.value.__cause__)
        del engine.model.forward
        ok = await backend.generate(GenerationRequest("ok", p, greedy(4)))
        assert engine.cache.num_free == engine.max_batch_size
        await backend.shutdown()
        return ok

    assert run_async(main()).finish_reason == "length"


def test_a_dead_worker_fails_waiting_and_later_callers():
    model = tiny_model()

    async def main():
        engine = make_engine(model)
        backend = NativeBackend(engine)
        await backend.start()
        engine.has_work = lambda: (_ for _ in ()).throw(RuntimeError("worker bug"))
        with pytest.raises(GenerationError, match="worker bug"):
            await backend.generate(GenerationRequest("a", [1, 2, 3], greedy()))
        with pytest.raises(GenerationError, match="died"):
            await backend.generate(GenerationRequest("b", [1, 2, 3], greedy()))
        await backend.shutdown()

    run_async(main())


def test_cancelled_generate_aborts_and_shutdown_aborts_pending():
    model = tiny_model()
    ps = prompts(3)

    async def main():
        engine = make_engine(model, step_delay_s=0.005)
        backend = NativeBackend(engine)
        await backend.start()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(backend.generate(GenerationRequest("slow", ps[0], greedy(50))), 0.05)
        await wait_until(lambda: engine.num_running == 0)
        pending = [asyncio.create_task(backend.generate(GenerationRequest(str(i), p, greedy(50))))
                   for i, p in enumerate(ps)]
        await wait_until(lambda: engine.num_running == 3)
        await backend.shutdown()
        results = await asyncio.gather(*pending)
        with pytest.raises(RuntimeError, match="shut down"):
            await backend.generate(GenerationRequest("late", ps[0], greedy()))
        return results, backend.metrics()

    results, metrics = run_async(main())
    assert [r.finish_reason for r in results] == ["abort"] * 3
    assert metrics["requests_aborted"] == 4


def test_generate_stream_yields_every_token_once_and_closing_early_aborts():
    from rl_core.generation import StreamDelta

    model = tiny_model()
    p = prompts(1)[0]

    async def main():
        engine = make_engine(model, step_delay_s=0.002)
        backend = NativeBackend(engine)
        await backend.start()
        items = [item async for item in backend.generate_stream(
            GenerationRequest("s", p, SamplingParams(temperature=1.0, max_tokens=12, seed=4, top_logprobs=2)))]
        plain = await backend.generate(GenerationRequest("p", p, SamplingParams(temperature=1.0, max_tokens=12, seed=4)))
        stream = backend.generate_stream(GenerationRequest("early", p, greedy(200)))
        first = await stream.__anext__()
        await stream.aclose()  # the consumer leaves: the request is aborted in the engine
        await wait_until(lambda: engine.num_running == 0)
        metrics = backend.metrics()
        await backend.shutdown()
        return items, plain, first, metrics

    items, plain, first, metrics = run_async(main())
    deltas, final = items[:-1], items[-1]
    assert all(isinstance(d, StreamDelta) for d in deltas) and len(deltas) > 1
    assert [t for d in deltas for t in d.token_ids] == final.token_ids == plain.token_ids
    assert [x for d in deltas for x in d.logprobs] == final.logprobs
    assert [row for d in deltas for row in d.top_logprobs] == final.top_logprobs and len(final.top_logprobs[0]) == 2
    assert isinstance(first, StreamDelta) and metrics["requests_aborted"] == 1


def test_generate_many_equals_one_generate_per_request_and_cancelling_aborts_all():
    """The group call (rl_core.rollout.group uses it per prompt group): the same results, in
    order, as concurrent generate calls (lockstep: batches independent of thread timing);
    cancelled, every request is aborted in the engine."""
    model = tiny_model()
    ps = prompts(5, seed=4)
    sampled = [GenerationRequest(f"s{i}", p, SamplingParams(temperature=0.9, max_tokens=6, seed=100 + i))
               for i, p in enumerate(ps)]

    async def main():
        results = []
        for group_call in (True, False):  # lockstep: the same batches whatever the thread timing
            backend = NativeBackend(make_engine(model), lockstep=True)
            await backend.start()
            results.append(await backend.generate_many(sampled) if group_call
                           else await asyncio.gather(*(backend.generate(r) for r in sampled)))
            await backend.shutdown()
        many, one = results
        slow_engine = make_engine(model, step_delay_s=0.005)
        slow = NativeBackend(slow_engine)
        await slow.start()
        task = asyncio.create_task(slow.generate_many([GenerationRequest(f"c{i}", p, greedy(50))
                                                       for i, p in enumerate(ps[:3])]))
        await wait_until(lambda: slow_engine.num_running == 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: slow_engine.num_running == 0)
        metrics = slow.metrics()
        await slow.shutdown()
        return many, one, metrics

    many, one, metrics = run_async(main())
    assert [r.request_id for r in many] == [r.request_id for r in sampled]
    assert [r.token_ids for r in many] == [r.token_ids for r in one]
    assert [r.logprobs for r in many] == [r.logprobs for r in one]
    assert metrics["requests_aborted"] == 3
