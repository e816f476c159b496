"""The native engine on a tiny Mixtral (mixture of experts): logits and routed experts
against transformers, continuous batching == one request at a time (tokens, logprobs and
routes), route recording through preemption, refit by in-memory names, and the decode
paths it refuses."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from rl_core.generation import EngineOptions, NativeEngine
from rl_core.generation.native.moe import convert_legacy_moe
from rl_core.train.router_replay import find_routers
from rl_core.types import GenerationRequest, SamplingParams
from tests.helpers.engine_models import VOCAB, prompts, run

LAYERS, EXPERTS, TOP_K = 2, 4, 2


def tiny_moe(seed: int = 0, tied: bool = True) -> MixtralForCausalLM:
    """A seeded random Mixtral with diverse outputs (init std 0.3, perturbed norms)."""
    torch.manual_seed(seed)
    config = MixtralConfig(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=VOCAB, intermediate_size=96, max_position_embeddings=64, initializer_range=0.3,
                           num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, sliding_window=None,
                           tie_word_embeddings=tied, rope_theta=1000.0)
    model = MixtralForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def hf_routes(model, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' own top-k expert ids [B * L, layers, k] of a forward over input_ids."""
    seen = []
    hooks = [r.register_forward_hook(lambda mod, args, out: seen.append(out[2])) for r in find_routers(model)]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen, dim=1)


@pytest.fixture(scope="module")
def model():
    return tiny_moe()


def test_logits_and_routes_equal_transformers_fp32(model):
    engine = NativeEngine(model.config, model.state_dict(), EngineOptions(max_batch_size=4))
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    got = engine.model.sequence_logits(ids)
    assert expected.abs().max() > 1.0  # the test model is not trivially small
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    routes = engine.model.last_routes
    assert routes.shape == (3 * 11, LAYERS, TOP_K)
    assert torch.equal(routes, hf_routes(model, ids))
    assert len(routes.unique()) == EXPERTS  # every expert is used somewhere


def test_loads_hf_dir_with_per_expert_names_and_refits_in_memory_names(model, tmp_path):
    model.save_pretrained(tmp_path)
    # on disk: block_sparse_moe.experts.{e}.w1..
    engine = NativeEngine.from_pretrained(tmp_path, EngineOptions(max_batch_size=2))
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(engine.model.sequence_logits(ids), expected, atol=1e-4, rtol=1e-4)
    other = tiny_moe(seed=5)
    engine.update_weights(1, other.state_dict())  # a trainer's state dict: mlp.experts.gate_up_proj, ...
    with torch.no_grad():
        expected = other(input_ids=ids).logits
    torch.testing.assert_close(engine.model.sequence_logits(ids), expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="lack experts"):
        convert_legacy_moe({"model.layers.0.block_sparse_moe.experts.0.w1.weight": torch.zeros(2, 2)}, EXPERTS)


def test_generation_records_routes_equal_to_transformers_topk(model):
    engine = NativeEngine(model.config, model.state_dict(), EngineOptions(max_batch_size=4))
    reqs = [GenerationRequest(f"r{i}", p, SamplingParams(greedy=True, max_tokens=6)) for i, p in enumerate(prompts(3))]
    for r in run(engine, reqs).values():
        seq = r.prompt_ids + r.token_ids
        # every token fed through the model has routes: the prompt and all sampled tokens but the last
        assert len(r.routed_experts) == len(seq) - 1
        assert all(len(x) == LAYERS * TOP_K for x in r.routed_experts)
        expected = hf_routes(model, torch.tensor([seq[:-1]]))
        assert torch.equal(torch.tensor(r.routed_experts).view(-1, LAYERS, TOP_K), expected)


def test_continuous_batching_equals_one_at_a_time(model):
    ps = prompts(6, seed=4)
    reqs = lambda: [GenerationRequest(f"r{i}", p, SamplingParams(greedy=True, max_tokens=8))  # noqa: E731
                    for i, p in enumerate(ps)]
    # small step budget: chunked prefill and decode rows share steps
    batched = run(NativeEngine(model.config, model.state_dict(), EngineOptions(max_batch_size=4, max_step_tokens=8)),
                  reqs())
    for req in reqs():
        alone = run(NativeEngine(model.config, model.state_dict(), EngineOptions(max_batch_size=1)),
                    [req])[req.request_id]
        got = batched[req.request_id]
        assert got.token_ids == alone.token_ids
        assert got.routed_experts == alone.routed_experts
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_preempted_and_invalidated_sequences_keep_routes_by_position(model):
    ps = prompts(4, seed=7)
    reqs = lambda: [GenerationRequest(f"r{i}", p, SamplingParams(greedy=True, max_tokens=10))  # noqa: E731
                    for i, p in enumerate(ps)]
    free = run(NativeEngine(model.config, model.state_dict(), EngineOptions(max_batch_size=4)), reqs())
    tight = NativeEngine(model.config, model.state_dict(), EngineOptions(max_batch_size=4, max_num_kv_tokens=30))
    squeezed = run(tight, reqs())
    assert tight.stats.preemptions > 0
    for rid, r in free.items():
        assert squeezed[rid].token_ids == r.token_ids
        assert squeezed[rid].routed_experts == r.routed_experts
    engine = NativeEngine(model.config, model.state_dict(), EngineOptions(max_batch_size=4))
    for r in reqs():
        engine.add_request(r)
    done = {}
    for step in range(100):
        if step == 3:
            engine.invalidate_kv_cache()
        done.update({r.request_id: r for r in engine.step()})
        if not engine.has_work():
            break
    assert {rid: r.routed_experts for rid, r in done.items()} == {rid: r.routed_experts for rid, r in free.items()}


def test_moe_refuses_static_decode_and_dense_records_nothing(model):
    for path in ("static",):
        with pytest.raises(ValueError, match="dense models only"):
            NativeEngine(model.config, model.state_dict(), EngineOptions(max_batch_size=2, decode_path=path))
    engine = NativeEngine(model.config, model.state_dict(), EngineOptions(max_batch_size=2, decode_path="auto"))
    assert engine.decode_path == "eager" and engine.decoder is None
    from tests.helpers.engine_models import tiny_model

    dense = tiny_model()
    res = run(NativeEngine(dense.config, dense.state_dict(), EngineOptions(max_batch_size=2)),
              [GenerationRequest("d", [1, 2, 3], SamplingParams(greedy=True, max_tokens=3))])
    assert res["d"].routed_experts is None
