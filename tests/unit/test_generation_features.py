"""NativeEngine features beyond the first slice: the static-shape decode path (what CUDA
graphs capture) against the packed eager path, graph buckets, the KV token budget
(admission, preemption, abort), the FP8 KV cache with KV-scale sync, top logprobs and
streaming progress."""

from __future__ import annotations

import pytest
import torch

from rl_core.generation.native.decode_graph import DecodeRunner, key_buckets, pick_bucket, slot_buckets
from rl_core.generation.native.kv_cache import FP8_E4M3_MAX, KVCache, dequantize_fp8, quantize_fp8
from rl_core.types import GenerationRequest, SamplingParams

from tests.helpers.engine_models import full_logprobs, greedy, make_engine, prompts, run
from tests.helpers.engine_models import tiny_model as _tiny_model


def tiny_model(arch: str = "qwen2", seed: int = 0, init: float = 0.3):
    return _tiny_model(arch, seed, init, max_positions=96)  # room for the budget and FP8 tests' prompts


# ---------------------------------------------------------------------- static decode (graph) path


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_static_decode_path_matches_eager_path(arch):
    model = tiny_model(arch)
    ps = prompts(10, lengths=(2, 14))
    params = [greedy(4 + i % 9) if i % 3 else SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=i)
              for i in range(len(ps))]
    reqs = [GenerationRequest(str(i), p, sp) for i, (p, sp) in enumerate(zip(ps, params))]
    arrivals = [0, 0, 1, 1, 3, 6, 6, 9, 12, 15]
    eager = run(make_engine(model, max_batch_size=5, decode_path="eager"), reqs, arrivals)
    engine = make_engine(model, max_batch_size=5, decode_path="static")
    static = run(engine, reqs, arrivals)
    for req in reqs:
        assert static[req.request_id].token_ids == eager[req.request_id].token_ids
        assert torch.allclose(torch.tensor(static[req.request_id].logprobs),
                              torch.tensor(eager[req.request_id].logprobs), atol=1e-5)
    # most steps are pure decode steps and went through the runner (slots with gaps included)
    assert engine.stats.static_decode_steps > engine.stats.steps // 2
    assert engine.decoder.eager_runs == engine.stats.static_decode_steps and engine.decoder.num_graphs == 0


def test_static_decode_samples_plain_rows_in_the_step_like_the_engine_sampler():
    """Greedy and temperature rows (seeded or drawing from the engine's generator) sample
    inside the decode step (`sample_plain`, what the CUDA graph captures): the same tokens
    and logprobs as the packed eager path, whose engine samples with `sample_tokens`."""
    model = tiny_model()
    ps = prompts(8, lengths=(2, 10))
    params = [greedy(9) if i % 3 == 0 else SamplingParams(temperature=0.6 + 0.1 * i, max_tokens=10,
                                                          seed=i if i % 2 else None) for i in range(len(ps))]
    reqs = [GenerationRequest(str(i), p, sp) for i, (p, sp) in enumerate(zip(ps, params))]
    arrivals = [0, 0, 1, 2, 2, 4, 7, 7]
    eager = run(make_engine(model, max_batch_size=4, decode_path="eager", seed=3), reqs, arrivals)
    engine = make_engine(model, max_batch_size=4, decode_path="static", seed=3)
    static = run(engine, reqs, arrivals)
    for req in reqs:
        assert static[req.request_id].token_ids == eager[req.request_id].token_ids
        assert torch.allclose(torch.tensor(static[req.request_id].logprobs),
                              torch.tensor(eager[req.request_id].logprobs), atol=1e-5)
    assert engine.decoder.sampled_steps == engine.stats.static_decode_steps > 0


def test_static_decode_logprobs_match_transformers():
    model = tiny_model()
    engine = make_engine(model, decode_path="static")
    ps = prompts(4)
    reqs = [GenerationRequest(str(i), p, SamplingParams(temperature=0.7, max_tokens=10, seed=i))
            for i, p in enumerate(ps)]
    out = run(engine, reqs, [0, 1, 2, 2])
    for req in reqs:
        ref = full_logprobs(model, req.prompt_ids, out[req.request_id].token_ids, 0.7)
        assert (torch.tensor(out[req.request_id].logprobs) - ref).abs().max().item() < 1e-4


def test_buckets():
    assert slot_buckets(256) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    assert slot_buckets(5) == [1, 2, 4, 5]
    assert slot_buckets(600)[-3:] == [512, 576, 600]
    assert key_buckets(328) == [64, 128, 256, 328] and key_buckets(64) == [64] and key_buckets(40) == [40]
    assert pick_bucket([1, 2, 4, 8], 3) == 4 and pick_bucket([1, 2, 4, 8], 8) == 8
    with pytest.raises(ValueError):
        pick_bucket([1, 2, 4, 8], 9)
    model = tiny_model()
    engine = make_engine(model, max_batch_size=40, max_seq_len=90, decode_path="static")
    cache = engine.cache
    for _ in range(3):
        cache.allocate()
    cache.lengths[:3] = [5, 70, 12]
    assert engine.decoder.buckets_for([0, 2]) == (4, 64)  # slot 2 -> S 4 (3 slots); position 12 -> K 64
    assert engine.decoder.buckets_for([0, 1, 2]) == (4, 90)  # position 70 -> the cap, max_seq_len
    with pytest.raises(ValueError, match="CUDA"):
        DecodeRunner(engine.model, cache, use_graphs=True)
    with pytest.raises(ValueError, match="CUDA"):
        make_engine(model, decode_path="graph")
    with pytest.raises(ValueError, match="decode_path"):
        make_engine(model, decode_path="fast")


# ---------------------------------------------------------------------- KV token budget


def test_token_budget_bounds_held_tokens_and_preemption_keeps_greedy_tokens():
    model = tiny_model()
    ps = prompts(8, lengths=(6, 12))
    reqs = [GenerationRequest(str(i), p, greedy(20)) for i, p in enumerate(ps)]
    free = run(make_engine(model, max_batch_size=8), reqs)
    budget = 64
    held = []
    engine = make_engine(model, max_batch_size=8, max_num_kv_tokens=budget)
    limited = run(engine, reqs, each_step=lambda e: held.append(e.kv_tokens))
    assert max(held) <= budget
    assert engine.stats.preemptions > 0  # the budget really bit: sequences were sent back and recomputed
    for req in reqs:
        got, want = limited[req.request_id], free[req.request_id]
        assert got.token_ids == want.token_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
    assert engine.kv_tokens == 0 and engine.cache.num_free == 8


def test_admission_waits_for_budget_and_abort_frees_it_at_once():
    model = tiny_model()
    a, b = prompts(2, lengths=(10, 10))
    engine = make_engine(model, max_batch_size=4, max_num_kv_tokens=22)
    engine.add_request(GenerationRequest("a", a, greedy(12)))  # 10 + 12 = 22 fits alone
    engine.step()
    engine.add_request(GenerationRequest("b", b, greedy(4)))
    engine.step()  # a holds 10 + 1 pending; b's 10 + one token of growth each (2) = 23 > 22
    assert engine.num_running == 1 and engine.num_waiting == 1 and engine.cache.num_free == 3
    engine.abort("a")
    assert engine.kv_tokens == 0
    engine.step()
    assert engine.num_running == 1 and engine.progress("b")[0]  # b admitted and sampled in that very step
    with pytest.raises(ValueError, match="max_num_kv_tokens"):
        engine.add_request(GenerationRequest("big", a, greedy(13)))  # 10 + 13 > 22 could never fit alone


# ---------------------------------------------------------------------- FP8 KV cache


def test_fp8_round_trip_and_saturation():
    x = torch.randn(50, 3, 16) * torch.tensor([0.01, 1.0, 30.0])[None, :, None]
    scale = x.abs().amax(dim=(0, 2)) / FP8_E4M3_MAX
    q = quantize_fp8(x, scale)
    assert q.dtype == torch.float8_e4m3fn
    back = dequantize_fp8(q.permute(1, 0, 2)[None], scale, torch.float32)[0].permute(1, 0, 2)
    rel = ((back - x).abs() / x.abs().clamp(min=1e-30))[x.abs() > scale[None, :, None] * 2**-6]
    assert rel.max().item() <= 2**-4 + 1e-6  # e4m3: 3 mantissa bits -> rounding error <= 2^-4 relative
    big = quantize_fp8(torch.full((1, 3, 1), 1e6), torch.ones(3))
    assert big.float().max().item() == FP8_E4M3_MAX  # saturates instead of overflowing to NaN


def test_fp8_cache_write_gather_and_requantize():
    cache = KVCache(2, 4, 16, 2, 8, dtype=torch.float32, storage="fp8_e4m3")
    assert cache.k.element_size() == 1 and cache.nbytes == 2 * 2 * 4 * 2 * 16 * 8
    cache.set_scales(torch.full((2, 2), 0.01), torch.full((2, 2), 0.02), requantize=False)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots, pos = torch.tensor([1, 1, 1, 2, 2]), torch.tensor([0, 1, 2, 0, 1])
    for s in range(3):
        cache.allocate()
    cache.write(1, slots, pos, k, v)
    cache.lengths[1], cache.lengths[2] = 3, 2
    keys, values = cache.gather(1, torch.tensor([1, 2]), 3, slot_start=1)
    assert keys.dtype == torch.float32
    assert torch.allclose(keys[0, :, :3].transpose(0, 1), k[:3], rtol=0.07, atol=0.01 * 2**-6)
    assert torch.allclose(values[1, :, :2].transpose(0, 1), v[3:], rtol=0.07, atol=0.02 * 2**-6)
    keys2, _ = cache.gather(1, torch.tensor([2, 1]), 3, slot_start=None)  # copy path, fp8 via uint8
    assert torch.equal(keys2[1], keys[0])
    cache.set_scales(torch.full((2, 2), 0.02), torch.full((2, 2), 0.02))  # re-encoded, same values
    again, _ = cache.gather(1, torch.tensor([1, 2]), 3, slot_start=1)
    assert torch.allclose(again, keys, rtol=0.07, atol=1e-3)
    with pytest.raises(ValueError, match="shape"):
        cache.set_scales(torch.ones(3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="> 0"):
        cache.set_scales(torch.zeros(2, 2), torch.ones(2, 2))


@pytest.mark.parametrize("decode_path", ["eager", "static"])
def test_fp8_engine_tracks_full_precision(decode_path):
    model = tiny_model(init=0.1)
    ps = prompts(6)
    reqs = [GenerationRequest(str(i), p, SamplingParams(temperature=1.0, max_tokens=12, seed=i))
            for i, p in enumerate(ps)]
    engine = make_engine(model, kv_cache_dtype="fp8_e4m3", decode_path=decode_path)
    assert engine.cache.k.dtype == torch.float8_e4m3fn and engine.stats.kv_calibrations == 1
    out = run(engine, reqs, [0, 0, 1, 2, 3, 3])
    gaps = torch.cat([(torch.tensor(out[r.request_id].logprobs)
                       - full_logprobs(model, r.prompt_ids, out[r.request_id].token_ids)).abs() for r in reqs])
    assert 1e-4 < gaps.max().item()  # really quantised
    assert gaps.mean().item() < 0.05 and gaps.max().item() < 0.2


def test_kv_scale_sync_at_refit():
    model = tiny_model()
    engine = make_engine(model, kv_cache_dtype="fp8_e4m3", kv_scale_margin=1.0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    k0, v0 = engine.cache.k_scale.clone(), engine.cache.v_scale.clone()
    # calibration = amax of cached keys/values / 448 (margin 1): compare with the model's own pass
    k_amax, v_amax = engine.model.kv_amax(engine.kv_sync.sequences())
    assert torch.allclose(k0, k_amax / FP8_E4M3_MAX) and torch.allclose(v0, v_amax / FP8_E4M3_MAX)
    # refit to weights whose last-layer keys are 8x larger (k_proj weight and bias): those key
    # scales follow exactly; nothing upstream of them changed, so every other scale stays
    for name in list(state):
        if "layers.1.self_attn.k_proj" in name:
            state[name] = state[name] * 8.0
    engine.update_weights(1, state)
    assert engine.stats.kv_calibrations == 2
    assert torch.allclose(engine.cache.k_scale[1], 8.0 * k0[1], rtol=1e-4)
    assert torch.allclose(engine.cache.k_scale[0], k0[0]) and torch.allclose(engine.cache.v_scale, v0)
    # explicit scales are applied as given (e.g. computed by the trainer)
    engine.update_weights(2, state, kv_scales=(k0 * 3, v0 * 3))
    assert torch.equal(engine.cache.k_scale, k0 * 3) and torch.equal(engine.cache.v_scale, v0 * 3)
    with pytest.raises(ValueError, match="not FP8"):
        make_engine(model).update_weights(1, state, kv_scales=(k0, v0))


def test_stale_kv_scales_clip_and_the_sync_repairs_them():
    """Why scales must follow the policy: refit to an equivalent model (same function) whose
    keys and values are 40x larger (k, v x40; q, o /40). Keeping the old scales saturates
    the cache (logprobs far off); the calibration pass restores the usual FP8 accuracy."""
    model, big = tiny_model(init=0.1), tiny_model(init=0.1)
    with torch.no_grad():
        for name, p in big.named_parameters():
            if "k_proj" in name or "v_proj" in name:
                p.mul_(40.0)
            if "q_proj" in name or "o_proj" in name:
                p.div_(40.0)
    ps = prompts(4)
    reqs = [GenerationRequest(str(i), p, greedy(10)) for i, p in enumerate(ps)]

    def gap(engine):
        out = run(engine, reqs)
        return max((torch.tensor(out[r.request_id].logprobs)
                    - full_logprobs(big, r.prompt_ids, out[r.request_id].token_ids)).abs().max().item() for r in reqs)

    stale = make_engine(model, kv_cache_dtype="fp8_e4m3", kv_scale_margin=1.0)
    stale.update_weights(1, big.state_dict(), kv_scales=(stale.cache.k_scale.clone(), stale.cache.v_scale.clone()))
    synced = make_engine(model, kv_cache_dtype="fp8_e4m3", kv_scale_margin=1.0)
    synced.update_weights(1, big.state_dict())
    stale_gap, synced_gap = gap(stale), gap(synced)
    assert synced_gap < 0.2 and stale_gap > 1.0, (synced_gap, stale_gap)


# ---------------------------------------------------------------------- top logprobs, progress


def test_top_logprobs_and_progress():
    model = tiny_model()
    prompt = prompts(1)[0]
    engine = make_engine(model, decode_path="static")
    engine.add_request(GenerationRequest("t", prompt, SamplingParams(temperature=0.8, max_tokens=6, seed=3,
                                                                     top_logprobs=4)))
    engine.add_request(GenerationRequest("plain", prompt, greedy(6)))
    engine.step()
    engine.step()
    tokens, logprobs, top = engine.progress("t")
    assert len(tokens) == len(logprobs) == len(top) == 2 and engine.progress("nope") is None
    results = run(engine, [])
    while engine.has_work():
        results.update({r.request_id: r for r in engine.step()})
    res = results["t"]
    assert results["plain"].top_logprobs is None
    ids = torch.tensor([prompt + res.token_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float() / 0.8, dim=-1)[len(prompt) - 1:-1]
    for i, row in enumerate(res.top_logprobs):
        want = lp[i].topk(4)
        assert [t for t, _ in row] == want.indices.tolist()
        assert torch.allclose(torch.tensor([v for _, v in row]), want.values, atol=1e-4)
        assert row[0][1] >= res.logprobs[i] - 1e-6  # the sampled token is never above the best


# ---------------------------------------------------------------------- overlapped steps


def _overlap_requests(n=12):
    ps = prompts(n, lengths=(2, 12))
    params = [greedy(5 + i % 9) if i % 2 else SamplingParams(temperature=0.8, max_tokens=4 + i % 11, seed=100 + i)
              for i in range(n)]
    return [GenerationRequest(str(i), p, sp) for i, (p, sp) in enumerate(zip(ps, params))]


@pytest.mark.parametrize("budget", [None, 60])
def test_overlapped_steps_give_the_tokens_of_plain_steps(budget):
    """overlap_steps launches the next decode step before reading this one's tokens: greedy
    and seeded requests (arrivals mid-run, more requests than slots, end tokens, a tight KV
    budget) get the same tokens, logprobs and versions as without overlap."""
    model = tiny_model()
    reqs = _overlap_requests()
    arrivals = [0, 0, 0, 1, 2, 5, 5, 6, 9, 14, 14, 20]
    kwargs = dict(max_batch_size=5, decode_path="static", eos_token_ids=[7, 11], max_num_kv_tokens=budget)
    ref = run(make_engine(model, **kwargs), reqs, arrivals)
    engine = make_engine(model, overlap_steps=True, **kwargs)
    got = run(engine, reqs, arrivals)
    assert {r.finish_reason for r in ref.values()} == {"stop", "length"}
    for req in reqs:
        a, b = got[req.request_id], ref[req.request_id]
        assert (a.token_ids, a.finish_reason, a.token_versions) == (b.token_ids, b.finish_reason, b.token_versions)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6)
    assert engine.stats.ahead_steps > engine.stats.steps // 3
    assert engine.stats.tokens_generated == sum(len(r.token_ids) for r in got.values())
    assert engine.kv_tokens == 0 and engine.cache.num_free == 5


def test_overlapped_steps_drain_before_weights_abort_and_invalidation():
    model, other = tiny_model(seed=0), tiny_model(seed=1)
    reqs = [GenerationRequest(str(i), p, greedy(14)) for i, p in enumerate(prompts(4))]
    engine = make_engine(model, max_batch_size=4, decode_path="static", eos_token_ids=[], overlap_steps=True)
    for r in reqs:
        engine.add_request(r)
    for _ in range(4):
        assert engine.step() == []
    assert engine._ahead is not None  # a step is in flight
    engine.update_weights(1, other.state_dict())
    assert engine._ahead is None
    aborted = engine.abort("0")
    assert aborted.finish_reason == "abort" and aborted.token_versions == [0] * len(aborted.token_ids)
    results = {}
    while engine.has_work():
        results.update({r.request_id: r for r in engine.step()})
    for rid in ("1", "2", "3"):
        versions = results[rid].token_versions
        assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
        assert len(results[rid].token_ids) == 14
    # invalidation in flight: greedy tokens as without overlap (the cache is recomputed, same weights)
    ref_engine = make_engine(model, max_batch_size=4, decode_path="static", eos_token_ids=[])
    ov_engine = make_engine(model, max_batch_size=4, decode_path="static", eos_token_ids=[], overlap_steps=True)
    outs = []
    for eng in (ref_engine, ov_engine):
        for r in reqs:
            eng.add_request(r)
        for _ in range(5):
            eng.step()
        eng.invalidate_kv_cache()
        out = {}
        while eng.has_work():
            out.update({r.request_id: r for r in eng.step()})
        outs.append(out)
    assert all(outs[0][r.request_id].token_ids == outs[1][r.request_id].token_ids for r in reqs)
    with pytest.raises(ValueError, match="overlap_steps"):
        make_engine(model, overlap_steps=True)  # auto on the CPU is eager
