"""NativeEngine against transformers on tiny random models: logits, logprobs, greedy
decoding, continuous batching, seeded sampling, stop rules, abort, refit, KV invalidation."""

from __future__ import annotations

import json

import pytest
import torch

from rl_core.generation import EngineOptions, NativeEngine
from rl_core.types import GenerationRequest, SamplingParams

from tests.helpers.engine_models import VOCAB, full_logprobs, greedy, make_engine, prompts, run, tiny_model


# ---------------------------------------------------------------------- model


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_logits_match_transformers(arch):
    model = tiny_model(arch)
    engine = make_engine(model)
    ids = torch.randint(0, VOCAB, (3, 17))
    with torch.no_grad():
        ref = model(ids).logits
    ours = engine.model.sequence_logits(ids)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


def test_from_pretrained_reads_safetensors_and_eos(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    engine = NativeEngine.from_pretrained(tmp_path, EngineOptions(max_batch_size=2))
    assert engine.eos_token_ids == {2, 7, 9}  # config.json (LlamaConfig default 2) + generation_config
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        ref = model(ids).logits
    assert (engine.model.sequence_logits(ids) - ref).abs().max().item() < 1e-4


def test_bad_weights_are_refused_and_leave_weights_unchanged():
    model = tiny_model()
    engine = make_engine(model)
    before = engine.model.model.embed_tokens.weight.clone()
    bad = dict(model.state_dict())
    bad["model.embed_tokens.weight"] = torch.zeros_like(bad["model.embed_tokens.weight"])
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(1, bad)
    with pytest.raises(ValueError, match="not a parameter"):
        engine.update_weights(1, {"model.nope.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="lacks"):
        engine.update_weights(1, {"model.norm.weight": torch.ones(64)})
    assert torch.equal(engine.model.model.embed_tokens.weight, before)
    assert engine.weight_version == 0


# ---------------------------------------------------------------------- greedy and logprobs


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_matches_transformers_generate(arch):
    model = tiny_model(arch)
    engine = make_engine(model)
    ps = prompts(5)
    results = run(engine, [GenerationRequest(str(i), p, greedy(10)) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=10, min_new_tokens=10,
                             pad_token_id=0, eos_token_id=None)
        assert results[str(i)].token_ids == out[0, len(p):].tolist()
        assert results[str(i)].finish_reason == "length"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_full_forward(temperature):
    model = tiny_model()
    engine = make_engine(model, seed=3)
    ps = prompts(6)
    params = [SamplingParams(temperature=temperature, max_tokens=8),
              SamplingParams(temperature=temperature, top_k=5, max_tokens=8),  # logprob is before filtering
              SamplingParams(temperature=temperature, top_p=0.5, max_tokens=8, seed=11),
              SamplingParams(greedy=True, temperature=temperature, max_tokens=8),  # greedy reports T = 1
              SamplingParams(temperature=temperature, max_tokens=8),
              SamplingParams(temperature=temperature, max_tokens=8)]
    reqs = [GenerationRequest(str(i), p, sp) for i, (p, sp) in enumerate(zip(ps, params))]
    results = run(engine, reqs, arrivals=[0, 0, 1, 2, 3, 3])
    for req in reqs:
        res = results[req.request_id]
        assert len(res.logprobs) == len(res.token_ids) == 8
        ref = full_logprobs(model, req.prompt_ids, res.token_ids, req.params.logprob_temperature)
        assert (torch.tensor(res.logprobs) - ref).abs().max().item() < 1e-4


# ---------------------------------------------------------------------- batching


def test_continuous_batching_matches_one_at_a_time():
    model = tiny_model()
    ps = prompts(9, lengths=(2, 12))
    reqs = [GenerationRequest(str(i), p, greedy(3 + i % 5)) for i, p in enumerate(ps)]
    alone = {}
    for req in reqs:
        alone.update(run(make_engine(model, max_batch_size=1), [req]))
    engine = make_engine(model, max_batch_size=4)  # more requests than slots: some wait in the queue
    batched = run(engine, reqs, arrivals=[0, 0, 1, 1, 2, 4, 4, 7, 9])
    for req in reqs:
        assert batched[req.request_id].token_ids == alone[req.request_id].token_ids
        assert torch.allclose(torch.tensor(batched[req.request_id].logprobs),
                              torch.tensor(alone[req.request_id].logprobs), atol=1e-5)
    assert engine.cache.num_free == 4 and not engine.has_work()


def test_chunked_prefill_matches_whole_prefill():
    model = tiny_model()
    ps = prompts(5, lengths=(10, 20))
    reqs = [GenerationRequest(str(i), p, greedy(6)) for i, p in enumerate(ps)]
    whole = run(make_engine(model), reqs)
    chunked_engine = make_engine(model, max_batch_size=4, max_step_tokens=5)
    chunked = run(chunked_engine, reqs, arrivals=[0, 0, 0, 3, 3])
    for req in reqs:
        assert chunked[req.request_id].token_ids == whole[req.request_id].token_ids
    assert max(rec.num_tokens for rec in chunked_engine.stats.trace) <= 5


def test_seeded_request_is_independent_of_its_batch():
    model = tiny_model()
    target = GenerationRequest("t", prompts(1, seed=5)[0],
                               SamplingParams(temperature=1.2, top_p=0.95, max_tokens=12, seed=1234))
    alone = run(make_engine(model, seed=0), [target])["t"]
    others = [GenerationRequest(f"o{i}", p, SamplingParams(max_tokens=4 + i, seed=i if i % 2 else None))
              for i, p in enumerate(prompts(7, seed=6))]
    busy = run(make_engine(model, seed=99, max_batch_size=5), others + [target], arrivals=[0, 0, 1, 1, 2, 2, 3, 2])
    assert busy["t"].token_ids == alone.token_ids
    assert len(set(alone.token_ids)) > 3  # really sampled, not a constant


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.5, top_k=1, max_tokens=8),
                                    SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=8)])
def test_top_k_one_and_tiny_top_p_equal_greedy(params):
    model = tiny_model()
    ps = prompts(4)
    want = run(make_engine(model), [GenerationRequest(str(i), p, greedy(8)) for i, p in enumerate(ps)])
    got = run(make_engine(model, seed=7), [GenerationRequest(str(i), p, params) for i, p in enumerate(ps)])
    for i in range(len(ps)):
        assert got[str(i)].token_ids == want[str(i)].token_ids


# ---------------------------------------------------------------------- stop rules


def test_finish_reasons():
    model = tiny_model()
    prompt = prompts(1, seed=8)[0]
    base = run(make_engine(model), [GenerationRequest("b", prompt, greedy(12))])["b"].token_ids
    assert len(set(base[:4])) == 4, base  # the checks below rely on distinct early tokens
    decode = lambda ids: "".join(f"<{t}>" for t in ids)  # noqa: E731
    engine = make_engine(model, decode=decode, eos_token_ids=[base[5]])
    reqs = [
        GenerationRequest("len", prompt, greedy(3)),
        GenerationRequest("stop_id", prompt, greedy(12, stop_token_ids=(base[2],))),
        GenerationRequest("eos", prompt, greedy(12)),
        GenerationRequest("stop_str", prompt, greedy(12, stop_strings=(f"<{base[1]}><{base[2]}>",))),
        GenerationRequest("seq_len", prompt, greedy(60)),
    ]
    out = run(engine, reqs[:4])
    assert (out["len"].token_ids, out["len"].finish_reason) == (base[:3], "length")
    assert (out["stop_id"].token_ids, out["stop_id"].finish_reason) == (base[:3], "stop")
    eos_at = base.index(base[5])
    assert (out["eos"].token_ids, out["eos"].finish_reason) == (base[:eos_at + 1], "stop")
    assert (out["stop_str"].token_ids, out["stop_str"].finish_reason) == (base[:3], "stop")
    # A stop string completed late (past the decoded tail window), one char per token, no eos.
    long_base = run(make_engine(model), [GenerationRequest("b", prompt, greedy(40))])["b"].token_ids
    char = lambda ids: "".join(chr(0x100 + t) for t in ids)  # noqa: E731
    late = run(make_engine(model, decode=char),
               [GenerationRequest("late", prompt, greedy(40, stop_strings=(char(long_base[30:32]),)))])["late"]
    first = next(i for i in range(1, 40) if long_base[i - 1:i + 1] == long_base[30:32])
    assert (late.token_ids, late.finish_reason) == (long_base[:first + 1], "stop")
    short = make_engine(model, max_seq_len=len(prompt) + 4)
    res = run(short, [reqs[4]])["seq_len"]
    assert (len(res.token_ids), res.finish_reason) == (4, "length")


def test_requests_the_engine_cannot_honour_are_refused():
    engine = make_engine(tiny_model(), max_seq_len=16)
    engine.add_request(GenerationRequest("a", [1, 2], greedy()))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request(GenerationRequest("a", [1, 2], greedy()))
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.add_request(GenerationRequest("long", list(range(16)), greedy()))
    with pytest.raises(ValueError, match="decode"):
        engine.add_request(GenerationRequest("s", [1], greedy(stop_strings=("x",))))
    with pytest.raises(ValueError, match="vocab|\\[0, 100\\)"):
        engine.add_request(GenerationRequest("v", [VOCAB], greedy()))
    assert engine.num_waiting == 1


# ---------------------------------------------------------------------- abort


def test_abort_frees_the_slot_and_a_queued_request_starts_next_step():
    model = tiny_model()
    engine = make_engine(model, max_batch_size=1)
    a, b = prompts(2)
    engine.add_request(GenerationRequest("a", a, greedy(20)))
    engine.add_request(GenerationRequest("b", b, greedy(2)))
    engine.step()
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1
    res = engine.abort("a")
    assert res.finish_reason == "abort" and len(res.token_ids) == 2 and len(res.logprobs) == 2
    assert engine.num_running == 0 and engine.cache.num_free == 1
    assert engine.abort("a") is None
    engine.step()  # b is admitted and prefilled in this very step
    assert engine.num_running == 1
    done = engine.step()
    assert [r.request_id for r in done] == ["b"]
    engine.add_request(GenerationRequest("c", a, greedy()))
    engine.add_request(GenerationRequest("d", b, greedy()))
    engine.step()
    res = engine.abort("d")  # still waiting: aborted with no tokens
    assert res.token_ids == [] and res.finish_reason == "abort" and engine.num_waiting == 0
    assert [r.request_id for r in engine.abort_all()] == ["c"] and not engine.has_work()


# ---------------------------------------------------------------------- refit


def test_update_weights_changes_outputs_and_records_versions():
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    engine = make_engine(old)
    prompt = prompts(1)[0]
    engine.add_request(GenerationRequest("span", prompt, greedy(6)))
    for _ in range(3):
        engine.step()
    engine.update_weights(1, new.state_dict())
    results = {}
    while engine.has_work():
        results.update({r.request_id: r for r in engine.step()})
    span = results["span"]
    assert span.token_versions == [0, 0, 0, 1, 1, 1]
    assert (span.start_version, span.end_version) == (0, 1)
    fresh = run(engine, [GenerationRequest("fresh", prompt, greedy(6))])["fresh"]
    ref = new.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, min_new_tokens=6,
                       pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    assert fresh.token_ids == ref and fresh.token_versions == [1] * 6
    assert fresh.token_ids != run(make_engine(old), [GenerationRequest("o", prompt, greedy(6))])["o"].token_ids


@pytest.mark.parametrize("invalidate", [True, False])
def test_invalidate_kv_cache_recomputes_under_new_weights(invalidate):
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    engine = make_engine(old, seed=5)
    ps = prompts(3)
    for i, p in enumerate(ps):
        engine.add_request(GenerationRequest(str(i), p, SamplingParams(temperature=0.8, max_tokens=8)))
    for _ in range(4):
        engine.step()
    engine.update_weights(1, new.state_dict())
    if invalidate:
        engine.invalidate_kv_cache()
    results = {}
    while engine.has_work():
        results.update({r.request_id: r for r in engine.step()})
    for i, p in enumerate(ps):
        res = results[str(i)]
        assert res.token_versions == [0] * 4 + [1] * 4
        ref_new = full_logprobs(new, p, res.token_ids, 0.8)[4:]
        gap = (torch.tensor(res.logprobs[4:]) - ref_new).abs().max().item()
        if invalidate:
            assert gap < 1e-4
        else:
            assert gap > 1e-3  # stale keys/values of the old weights still shape these tokens
        ref_old = full_logprobs(old, p, res.token_ids, 0.8)[:4]
        assert (torch.tensor(res.logprobs[:4]) - ref_old).abs().max().item() < 1e-4
