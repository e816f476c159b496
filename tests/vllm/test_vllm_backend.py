"""VLLMBackend on real vLLM: logprobs equal the trainer's, weight updates change outputs and
versions (in-flight requests included), abort, stop rules, cache reset, refused options.

One engine for the module (`tiny_backend`, a tied tiny Qwen2). Tests that change weights
restore the original ones at the end so that test order does not matter.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rl_core.types import GenerationRequest, SamplingParams
from tests.helpers.vllm_tier import (check_group_call, encode_prompt, generate_all, perturbed_weights,
                                    trainer_logprobs)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_agree_with_the_trainer(tiny_backend, loop, tokenizer, trainer, temperature):
    reqs = [GenerationRequest(f"lp{temperature}-{i}", encode_prompt(tokenizer, i),
                              SamplingParams(temperature=temperature, max_tokens=16, seed=i)) for i in range(32)]
    results = generate_all(loop, tiny_backend, reqs)
    assert all(r.finish_reason in ("stop", "length") for r in results)
    chunk, lp = trainer_logprobs(trainer, results, temperature, tokenizer.pad_token_id)
    mask = chunk.loss_mask.bool()
    err = (lp[mask] - chunk.gen_logprobs[mask]).abs()
    assert mask.sum() >= 32
    assert err.mean().item() < 1e-3, err.mean().item()
    assert err.max().item() < 1e-2


def test_greedy_and_seeded_requests_are_reproducible_and_match_the_native_engine(tiny_backend, loop, tokenizer,
                                                                                 tiny_policy):
    from rl_core.generation.native.engine import NativeEngine
    from rl_core.generation.native.options import EngineOptions

    greedy = SamplingParams(greedy=True, max_tokens=20)
    a = generate_all(loop, tiny_backend, [GenerationRequest(f"g{i}", encode_prompt(tokenizer, i), greedy) for i in range(4)])
    b = generate_all(loop, tiny_backend, [GenerationRequest(f"g2{i}", encode_prompt(tokenizer, i), greedy) for i in range(4)])
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    seeded = [GenerationRequest(f"s{k}{i}", encode_prompt(tokenizer, i), SamplingParams(max_tokens=12, seed=100 + i))
              for k in range(2) for i in range(4)]
    out = generate_all(loop, tiny_backend, seeded)
    assert [r.token_ids for r in out[:4]] == [r.token_ids for r in out[4:]]

    native = NativeEngine.from_pretrained(tiny_policy, EngineOptions(max_batch_size=4, max_seq_len=64))
    for i in range(4):
        native.add_request(GenerationRequest(f"n{i}", encode_prompt(tokenizer, i), greedy))
    done = {}
    while native.has_work():
        for r in native.step():
            done[r.request_id] = r
    for i, r in enumerate(a):
        n = done[f"n{i}"]
        assert n.token_ids == r.token_ids
        assert max(abs(x - y) for x, y in zip(n.logprobs, r.logprobs)) < 1e-3


def test_group_in_one_request_equals_its_samples_one_by_one(tiny_backend, loop, tokenizer):
    check_group_call(loop, tiny_backend, tokenizer, worker="vllm")


def test_weight_update_changes_outputs_and_versions(tiny_backend, loop, tokenizer, trainer):
    original = {k: v.clone() for k, v in trainer.export_weights().items()}
    new = perturbed_weights(trainer)
    full_new = dict(original, **new)
    full_new["lm_head.weight"] = full_new["model.embed_tokens.weight"]  # tied
    greedy = SamplingParams(greedy=True, max_tokens=16)
    v0 = tiny_backend.weight_version
    before = generate_all(loop, tiny_backend, [GenerationRequest(f"u0-{i}", encode_prompt(tokenizer, i), greedy) for i in range(4)])
    try:
        loop.run_until_complete(tiny_backend.update_weights(v0 + 1, new))
        assert tiny_backend.weight_version == v0 + 1
        after = generate_all(loop, tiny_backend, [GenerationRequest(f"u1-{i}", encode_prompt(tokenizer, i), greedy) for i in range(4)])
        changed = [max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) for a, b in zip(after, before)
                   if a.token_ids[:1] == b.token_ids[:1]]
        assert [r.token_ids for r in after] != [r.token_ids for r in before] or min(changed) > 1e-3
        for r in after:
            assert r.start_version == r.end_version == v0 + 1
            assert r.token_versions == [v0 + 1] * len(r.token_ids)
        # the served logits are the new weights' (the tied LM head was re-packed)
        chunk, lp = trainer_logprobs(trainer, after, 1.0, tokenizer.pad_token_id, state=full_new)
        mask = chunk.loss_mask.bool()
        assert (lp[mask] - chunk.gen_logprobs[mask]).abs().max().item() < 1e-3
    finally:
        loop.run_until_complete(tiny_backend.update_weights(v0 + 2, original))
    restored = generate_all(loop, tiny_backend, [GenerationRequest(f"u2-{i}", encode_prompt(tokenizer, i), greedy) for i in range(4)])
    assert [r.token_ids for r in restored] == [r.token_ids for r in before]
    assert max(abs(x - y) for a, b in zip(restored, before) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_in_flight_requests_switch_versions_mid_sequence(tiny_backend, loop, tokenizer, trainer):
    """Requests running across an update record both versions; each token's logprob is the
    one of the weights its version names (running requests are re-prefilled at the switch)."""
    original = {k: v.clone() for k, v in trainer.export_weights().items()}
    new = perturbed_weights(trainer, seed=2)
    full_new = dict(original, **new)
    full_new["lm_head.weight"] = full_new["model.embed_tokens.weight"]
    v0 = tiny_backend.weight_version
    params = SamplingParams(max_tokens=56, seed=7)

    async def go():
        reqs = [GenerationRequest(f"f{i}", encode_prompt(tokenizer, i), params) for i in range(48)]
        tasks = [asyncio.ensure_future(tiny_backend.generate(r)) for r in reqs]
        while tiny_backend.metrics()["tokens_generated"] == 0 and not any(t.done() for t in tasks):
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.02)
        await tiny_backend.update_weights(v0 + 1, new)
        return await asyncio.gather(*tasks)

    try:
        results = loop.run_until_complete(go())
    finally:
        loop.run_until_complete(tiny_backend.update_weights(v0 + 2, original))
    mixed = [r for r in results if len(set(r.token_versions)) == 2]
    assert mixed, "no request spanned the weight update"
    for r in results:
        assert r.token_versions == sorted(r.token_versions)
        assert r.start_version == v0 and r.end_version == v0 + 1
    _, lp_old = trainer_logprobs(trainer, mixed, 1.0, tokenizer.pad_token_id)
    chunk, lp_new = trainer_logprobs(trainer, mixed, 1.0, tokenizer.pad_token_id, state=full_new)
    for i, r in enumerate(mixed):
        p = len(r.prompt_ids)
        for j, version in enumerate(r.token_versions):
            ref = (lp_new if version == v0 + 1 else lp_old)[i, p + j].item()
            assert abs(ref - r.logprobs[j]) < 1e-3, (i, j, version, ref, r.logprobs[j])


def test_abort_ends_a_request_at_once(tiny_backend, loop, tokenizer):
    async def go():
        busy = [asyncio.ensure_future(tiny_backend.generate(GenerationRequest(
            f"busy{i}", encode_prompt(tokenizer, i), SamplingParams(max_tokens=56, seed=i)))) for i in range(32)]
        req = GenerationRequest("abort-me", encode_prompt(tokenizer, 0), SamplingParams(max_tokens=56, seed=3))
        task = asyncio.ensure_future(tiny_backend.generate(req))
        await asyncio.sleep(0)
        await tiny_backend.abort("abort-me")
        assert task.done()  # abort returns once the request has ended
        await tiny_backend.abort("no-such-request")  # unknown ids are ignored
        others = await asyncio.gather(*busy)
        return task.result(), others

    before = tiny_backend.metrics()["requests_aborted"]
    result, others = loop.run_until_complete(go())
    assert result.finish_reason == "abort"
    assert len(result.token_ids) < 56 and len(result.logprobs) == len(result.token_ids)
    assert all(r.finish_reason in ("stop", "length") for r in others)
    assert tiny_backend.metrics()["requests_aborted"] == before + 1
    assert tiny_backend.metrics()["running"] == 0


def test_stop_string_and_stop_token_keep_the_completing_token(tiny_backend, loop, tokenizer):
    greedy = SamplingParams(greedy=True, max_tokens=20)
    base = generate_all(loop, tiny_backend, [GenerationRequest("st0", encode_prompt(tokenizer, 1), greedy)])[0]
    target = base.token_ids[2]
    by_token = generate_all(loop, tiny_backend, [GenerationRequest(
        "st1", encode_prompt(tokenizer, 1), SamplingParams(greedy=True, max_tokens=20, stop_token_ids=(target,)))])[0]
    first = base.token_ids.index(target)
    assert by_token.finish_reason == "stop" and by_token.token_ids == base.token_ids[: first + 1]
    text = tokenizer.decode(base.token_ids[:3], skip_special_tokens=True)
    by_text = generate_all(loop, tiny_backend, [GenerationRequest(
        "st2", encode_prompt(tokenizer, 1), SamplingParams(greedy=True, max_tokens=20, stop_strings=(text,)))])[0]
    assert by_text.finish_reason == "stop"
    assert by_text.token_ids == base.token_ids[: len(by_text.token_ids)]
    assert text in tokenizer.decode(by_text.token_ids, skip_special_tokens=True)


def test_invalidate_kv_cache_keeps_outputs_exact(tiny_backend, loop, tokenizer):
    greedy = SamplingParams(greedy=True, max_tokens=16)
    a = generate_all(loop, tiny_backend, [GenerationRequest("kv0", encode_prompt(tokenizer, 2), greedy)])[0]
    loop.run_until_complete(tiny_backend.invalidate_kv_cache())
    b = generate_all(loop, tiny_backend, [GenerationRequest("kv1", encode_prompt(tokenizer, 2), greedy)])[0]
    assert a.token_ids == b.token_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert tiny_backend.metrics()["kv_invalidations"] >= 1


def test_filtered_sampling_is_refused(tiny_backend, loop, tokenizer):
    for params in (SamplingParams(top_p=0.9), SamplingParams(top_k=5), SamplingParams(temperature=0.001)):
        with pytest.raises(ValueError, match="vLLM"):
            generate_all(loop, tiny_backend, [GenerationRequest("bad", encode_prompt(tokenizer, 0), params)])
    assert tiny_backend.capacity() == 64


def test_top_logprobs_are_the_k_most_likely_tokens(tiny_backend, loop, tokenizer, trainer):
    req = GenerationRequest("top", encode_prompt(tokenizer, 0), SamplingParams(max_tokens=6, seed=1, top_logprobs=3))
    r = generate_all(loop, tiny_backend, [req])[0]
    assert len(r.top_logprobs) == len(r.token_ids) and all(len(t) == 3 for t in r.top_logprobs)
    with torch.no_grad():
        logits = trainer.model(torch.tensor([r.prompt_ids + r.token_ids])).logits[0].float()
    p = len(r.prompt_ids)
    for j, top in enumerate(r.top_logprobs):
        ref = torch.log_softmax(logits[p - 1 + j], -1).topk(3)
        assert [t for t, _ in top] == ref.indices.tolist()
        assert max(abs(lp - x) for (_, lp), x in zip(top, ref.values.tolist())) < 1e-3
