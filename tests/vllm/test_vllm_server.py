"""VLLMServerBackend on a real vLLM OpenAI-compatible server process (placement `separate`):
token-in/token-out generation with logprobs equal to the trainer's, weight updates through
files with per-token versions, abort, and a shutdown that leaves no process behind."""

from __future__ import annotations

import asyncio

import psutil
import pytest

from rl_core.types import GenerationRequest, SamplingParams

from tests.helpers.vllm_tier import (check_group_call, encode_prompt, generate_all, perturbed_weights, started,
                                    trainer_logprobs)


@pytest.fixture(scope="module")
def server(tiny_policy, loop, tmp_path_factory):
    from rl_core.generation.vllm.backend import VLLMOptions
    from rl_core.generation.vllm.server import VLLMServerBackend

    backend = started(loop, VLLMServerBackend(VLLMOptions(model=str(tiny_policy), max_model_len=64, max_num_seqs=64),
                                              weights_dir=tmp_path_factory.mktemp("server_weights"),
                                              startup_timeout_s=300))
    yield backend
    pids = set(backend._reaper.pids) | ({backend._proc.pid} if backend._proc else set())
    loop.run_until_complete(backend.shutdown())
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"vLLM server processes left behind: {alive}"


def test_server_logprobs_agree_with_the_trainer_and_the_async_engine(server, tiny_backend, loop, tokenizer, trainer):
    reqs = [GenerationRequest(f"sv{i}", encode_prompt(tokenizer, i), SamplingParams(temperature=0.7, max_tokens=16, seed=i))
            for i in range(16)]
    results = generate_all(loop, server, reqs)
    chunk, lp = trainer_logprobs(trainer, results, 0.7, tokenizer.pad_token_id)
    mask = chunk.loss_mask.bool()
    assert (lp[mask] - chunk.gen_logprobs[mask]).abs().mean().item() < 1e-3
    assert all(r.token_versions == [server.weight_version] * len(r.token_ids) for r in results)
    greedy = SamplingParams(greedy=True, max_tokens=16)
    a = generate_all(loop, server, [GenerationRequest(f"sg{i}", encode_prompt(tokenizer, i), greedy) for i in range(4)])
    b = generate_all(loop, tiny_backend, [GenerationRequest(f"eg{i}", encode_prompt(tokenizer, i), greedy) for i in range(4)])
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_server_group_in_one_request_equals_its_samples_one_by_one(server, loop, tokenizer):
    check_group_call(loop, server, tokenizer, worker=server.url)


def test_server_weight_update_changes_logprobs_and_versions(server, loop, tokenizer, trainer):
    original = {k: v.clone() for k, v in trainer.export_weights().items()}
    new = perturbed_weights(trainer, seed=5)
    full_new = dict(original, **new)
    full_new["lm_head.weight"] = full_new["model.embed_tokens.weight"]
    v0 = server.weight_version
    greedy = SamplingParams(greedy=True, max_tokens=12)
    before = generate_all(loop, server, [GenerationRequest(f"w0-{i}", encode_prompt(tokenizer, i), greedy) for i in range(4)])
    try:
        loop.run_until_complete(server.update_weights(v0 + 1, new))
        after = generate_all(loop, server, [GenerationRequest(f"w1-{i}", encode_prompt(tokenizer, i), greedy) for i in range(4)])
        assert all(r.token_versions == [v0 + 1] * len(r.token_ids) and r.start_version == v0 + 1 for r in after)
        chunk, lp = trainer_logprobs(trainer, after, 1.0, tokenizer.pad_token_id, state=full_new)
        mask = chunk.loss_mask.bool()
        assert (lp[mask] - chunk.gen_logprobs[mask]).abs().max().item() < 1e-3
        assert any(abs(x - y) > 1e-3 for a, b in zip(after, before) for x, y in zip(a.logprobs, b.logprobs))
    finally:
        loop.run_until_complete(server.update_weights(v0 + 2, original))
    assert len(list(server.weights_dir.glob("*.safetensors"))) == 1  # older update files are removed


def test_server_abort(server, loop, tokenizer):
    async def go():
        busy = [asyncio.ensure_future(server.generate(GenerationRequest(
            f"sb{i}", encode_prompt(tokenizer, i), SamplingParams(max_tokens=56, seed=i)))) for i in range(32)]
        task = asyncio.ensure_future(server.generate(GenerationRequest(
            "s-abort", encode_prompt(tokenizer, 0), SamplingParams(max_tokens=56, seed=1))))
        await asyncio.sleep(0.01)
        await server.abort("s-abort")
        assert task.done()
        return task.result(), await asyncio.gather(*busy)

    result, others = loop.run_until_complete(go())
    assert result.finish_reason == "abort" and len(result.token_ids) < 56
    assert all(r.finish_reason in ("stop", "length") for r in others)
