"""Router replay (R3) in the torch trainer: trainer logprobs of MoE samples match generation
logprobs more closely with replay than without (the issue's done-when, numbers printed),
replay really forces the recorded routes and keeps router gradients, missing routes fail
loudly, partial routes are backfilled and measured, routes survive chunk packing, and the
recipe rules that refuse replay where it cannot be honoured."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from rl_core.algorithms.losses import make_loss
from rl_core.config import validate_dict
from rl_core.config.schema import LossConfig, TrainerConfig
from rl_core.errors import RecipeError
from rl_core.generation import EngineOptions, NativeEngine
from rl_core.train.router_replay import find_routers
from rl_core.train.torch_trainer import TorchTrainer
from rl_core.packing import make_train_chunk
from rl_core.types import GenerationRequest, Sample, SamplingParams, TrainChunk

VOCAB, LAYERS, EXPERTS, TOP_K = 100, 4, 8, 2
REPLAY = TrainerConfig(router_replay={"enabled": True}, microbatch_size=16)
NO_REPLAY = TrainerConfig(microbatch_size=16)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A Mixtral whose experts matter (std 0.3) and whose router is small (std 0.02), saved as an HF dir."""
    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=VOCAB, intermediate_size=64, max_position_embeddings=64,
                           num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, sliding_window=None,
                           tie_word_embeddings=True, eos_token_id=0)
    model = MixtralForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.02, generator=g)
            layer.mlp.experts.gate_up_proj.normal_(0, 0.3, generator=g)
            layer.mlp.experts.down_proj.normal_(0, 0.3, generator=g)
    out = tmp_path_factory.mktemp("moe") / "policy"
    model.save_pretrained(out)
    return out


def generate(model_dir, dtype: str, n: int = 32, max_tokens: int = 16, device: str = "cpu") -> list[Sample]:
    engine = NativeEngine.from_pretrained(model_dir,
                                          EngineOptions(dtype=dtype, max_batch_size=n, seed=0, device=device))
    g = torch.Generator().manual_seed(2)
    for i in range(n):
        prompt = torch.randint(1, VOCAB, (8,), generator=g).tolist()
        engine.add_request(GenerationRequest(f"r{i}", prompt, SamplingParams(temperature=1.0, max_tokens=max_tokens,
                                                                             seed=i)))
    results = []
    while engine.has_work():
        results += engine.step()
    results.sort(key=lambda r: int(r.request_id[1:]))
    return [Sample(r.prompt_ids, r.token_ids, r.logprobs, float(i % 2), r.finish_reason, 0, 0,
                   routed_experts=r.routed_experts) for i, r in enumerate(results)]


@pytest.fixture(scope="module")
def bf16_samples(moe_dir):
    return generate(moe_dir, "bfloat16")


def own_routes(trainer: TorchTrainer, chunk: TrainChunk) -> torch.Tensor:
    """The trainer's own top-k [B, T, layers * k] (sorted per layer) on the chunk's tokens."""
    seen = []
    hooks = [r.register_forward_hook(lambda m, a, o: seen.append(o[2])) for r in find_routers(trainer.model)]
    try:
        with torch.no_grad():
            trainer.model(input_ids=chunk.input_ids.to(trainer.device),
                          attention_mask=chunk.attention_mask.to(trainer.device))
    finally:
        for h in hooks:
            h.remove()
    b, t = chunk.input_ids.shape
    return torch.stack(seen, dim=1).sort(dim=-1).values.reshape(b, t, -1).cpu()


def mismatch(trainer_plain: TorchTrainer, trainer_replay: TorchTrainer,
             chunk: TrainChunk) -> tuple[float, float, float]:
    """(fraction of counted tokens whose routes the plain trainer flips, mean |trainer - generation
    logprob| over completion tokens without replay, the same with replay)."""
    mask = chunk.loss_mask.bool()
    k = trainer_replay.replay.top_k
    recorded = chunk.routed_experts.view(*chunk.input_ids.shape, -1, k).sort(dim=-1).values.flatten(2)
    counted = counted_tokens(chunk)
    flip_frac = float(((own_routes(trainer_plain, chunk) != recorded).any(dim=-1) & counted).sum() / counted.sum())
    err_plain = float((trainer_plain.logprobs(chunk).cpu() - chunk.gen_logprobs)[mask].abs().mean())
    err_replay = float((trainer_replay.logprobs(chunk).cpu() - chunk.gen_logprobs)[mask].abs().mean())
    return flip_frac, err_plain, err_replay


def counted_tokens(chunk: TrainChunk) -> torch.Tensor:
    lengths = chunk.attention_mask.sum(dim=1)
    return torch.arange(chunk.input_ids.shape[1])[None, :] < (lengths - 1)[:, None]


def test_replay_brings_trainer_logprobs_closer_to_bf16_generation(moe_dir, bf16_samples):
    """The done-when: bf16 generation vs an fp32 trainer; near-tie routes flip for some
    tokens, and replaying generation's routes shrinks the logprob mismatch."""
    chunk = make_train_chunk(bf16_samples, [0.0] * len(bf16_samples), require_routes=True)
    mask = chunk.loss_mask.bool()
    flip_frac, err_plain, err_replay = mismatch(TorchTrainer(moe_dir, NO_REPLAY), TorchTrainer(moe_dir, REPLAY), chunk)
    print(f"\nMoE bf16 generation vs fp32 trainer over {int(mask.sum())} completion tokens: routes flipped for "
          f"{flip_frac:.2%} of tokens; mean |trainer - generation logprob| without replay {err_plain:.6f}, "
          f"with replay {err_replay:.6f} ({err_plain / err_replay:.2f}x smaller)")
    assert flip_frac > 0.002  # the no-replay trainer really routes some tokens elsewhere
    assert err_replay < 0.75 * err_plain
    assert err_replay > 0  # bf16 vs fp32 still differ: the comparison is not between identical computations


def test_replay_forces_recorded_routes_and_keeps_router_gradients(moe_dir):
    samples = generate(moe_dir, "float32", n=6, max_tokens=6)
    chunk = make_train_chunk(samples, [1.0, -1.0] * 3, require_routes=True)
    mask = chunk.loss_mask.bool()
    trainer = TorchTrainer(moe_dir, REPLAY, keep_reference=True)
    lp = trainer.logprobs(chunk)
    # fp32 both sides, same routes: generation and trainer agree to rounding
    assert (lp - chunk.gen_logprobs)[mask].abs().max() < 1e-4
    torch.testing.assert_close(trainer.logprobs(chunk, reference=True), lp)  # the reference replays too
    forced = chunk.routed_experts.clone()
    forced[..., 0::2], forced[..., 1::2] = 3, 5  # every token of every layer through experts 3 and 5
    forced_chunk = make_train_chunk(samples, [1.0, -1.0] * 3)
    forced_chunk.routed_experts = forced
    used = []
    hooks = [r.register_forward_hook(lambda m, a, o: used.append(o[2])) for r in find_routers(trainer.model)]
    lp_forced = trainer.logprobs(forced_chunk)
    for h in hooks:
        h.remove()
    assert all(torch.equal(u, forced.view(-1, LAYERS, TOP_K)[:, i]) for i, u in enumerate(used))
    assert (lp_forced - lp)[mask].abs().max() > 1e-2
    trainer.begin(make_loss(LossConfig()))
    trainer.train_microbatches(chunk)
    grad = trainer.model.model.layers[0].mlp.gate.weight.grad
    assert grad is not None and grad.abs().sum() > 0  # gates come from the router's softmax: it still learns
    metrics = trainer.finish()
    assert metrics["router_replay_backfill_frac"] == 0.0


def test_partial_routes_are_backfilled_and_measured(moe_dir):
    samples = generate(moe_dir, "float32", n=4, max_tokens=6)
    for s in samples[:2]:  # drop the routes of the first three tokens of two samples
        s.routed_experts = [[], [], []] + s.routed_experts[3:]
    chunk = make_train_chunk(samples, [1.0, -1.0, 1.0, -1.0], require_routes=True)
    counted = int(counted_tokens(chunk).sum())
    trainer = TorchTrainer(moe_dir, REPLAY)
    trainer.begin(make_loss(LossConfig()))
    trainer.train_microbatches(chunk)
    metrics = trainer.finish()
    assert metrics["router_replay_backfill_frac"] == pytest.approx(6 / counted)
    assert metrics["router_replay_backfill_frac"] > 0


def test_missing_routes_fail_loudly(moe_dir):
    samples = generate(moe_dir, "float32", n=3, max_tokens=4)
    bare = Sample(samples[0].prompt_ids, samples[0].completion_ids, samples[0].gen_logprobs, 0.0, "stop", 0, 0)
    with pytest.raises(ValueError, match=r"sample 1 of this batch .* carries no routed experts.*native"):
        make_train_chunk([samples[0], bare], [0.0, 0.0], require_routes=True)
    trainer = TorchTrainer(moe_dir, REPLAY)
    with pytest.raises(RuntimeError, match="carries no routed experts.*generation.backend 'native'"):
        trainer.logprobs(make_train_chunk([bare], [0.0]))  # no sample has routes: the chunk has none
    mixed = make_train_chunk([samples[0], bare, samples[1]], [0.0] * 3)  # one sample all -1
    with pytest.raises(RuntimeError, match=r"sample\(s\) \[1\]"):
        trainer.logprobs(mixed)
    wrong = make_train_chunk(samples, [0.0] * 3)
    wrong.routed_experts = wrong.routed_experts[..., :2]
    with pytest.raises(RuntimeError, match="another model"):
        trainer.logprobs(wrong)


def test_replay_on_a_dense_policy_is_a_recipe_error(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    Qwen2ForCausalLM(Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                 intermediate_size=32, vocab_size=VOCAB)).save_pretrained(tmp_path)
    with pytest.raises(RecipeError, match="trainer.router_replay.enabled"):
        TorchTrainer(tmp_path, REPLAY)


def test_routes_survive_concat_slice_and_take():
    a = Sample([1, 2], [3], [-0.5], 0.0, "stop", 0, 0, routed_experts=[[0, 1], [2, 3]])
    b = Sample([1, 2, 3, 4], [5, 6], [-0.1, -0.2], 0.0, "stop", 0, 0, routed_experts=[[1, 1]] * 5)
    ca, cb = make_train_chunk([a], [0.0]), make_train_chunk([b], [0.0])
    both = TrainChunk.concat([ca, cb])
    assert both.routed_experts.shape == (2, 6, 2)
    assert both.routed_experts[0].tolist() == [[0, 1], [2, 3]] + [[-1, -1]] * 4
    assert both.take(torch.tensor([0])).routed_experts.shape == (1, 3, 2)
    assert both.slice(1, 2).routed_experts[0, :5].tolist() == [[1, 1]] * 5
    assert make_train_chunk([Sample([1], [2], [-1.0], 0.0, "stop", 0, 0)], [0.0]).routed_experts is None


MOE = {"model": {"tiny": {"architecture": "mixtral", "num_experts": 4, "num_experts_per_tok": 2}}}


def _with(*parts: dict) -> dict:
    from rl_core.config.loader import deep_merge

    out: dict = {}
    for p in parts:
        out = deep_merge(out, p)
    return out


def test_recipe_rules():
    on = {"trainer": {"router_replay": {"enabled": True}}}
    cfg = validate_dict(_with(MOE, on))
    assert cfg.trainer.router_replay.enabled and cfg.model.tiny.num_experts == 4
    cases = [
        (on, "trainer.router_replay.enabled.*dense model.tiny.architecture 'qwen2'"),
        (_with(MOE, on, {"trainer": {"backend": "fsdp2"}}), "trainer.backend 'fsdp2'"),
        (_with(MOE, on, {"trainer": {"backend": "megatron"}}), "trainer.backend 'megatron'"),
        (_with(MOE, on, {"generation": {"backend": "vllm"}}), "generation.backend 'vllm'"),
        (_with(MOE, on, {"generation": {"backend": "http", "placement": "separate",
                                        "http": {"num_local_servers": 1}}}), "generation.backend 'http'"),
        (_with(MOE, {"generation": {"native": {"decode_path": "static"}}}), "generation.native.decode_path"),
        (_with(MOE, {"runtime": {"device": "cuda"}, "generation": {"native": {"decode_compile": True}}}),
         "generation.native.decode_compile"),
        ({"runtime": {"device": "cpu"}, "generation": {"native": {"decode_compile": True}}},
         "decode_compile.*resolves to eager"),
        ({"generation": {"native": {"decode_compile": True, "decode_path": "eager"}}}, "decode_compile"),
        ({"generation": {"native": {"overlap_steps": True, "decode_path": "eager"}}}, "overlap_steps"),
        (_with(MOE, {"runtime": {"device": "cuda"}, "generation": {"native": {"overlap_steps": True}}}),
         "generation.native.overlap_steps"),
        ({"model": {"tiny": {"architecture": "mixtral"}}}, "model.tiny.num_experts"),
        ({"model": {"tiny": {"num_experts": 4}}}, "model.tiny.num_experts.*dense"),
        (_with(MOE, {"model": {"tiny": {"num_experts_per_tok": 5}}}), "model.tiny.num_experts_per_tok"),
    ]
    for data, pattern in cases:
        with pytest.raises(RecipeError, match=pattern):
            validate_dict(data)


def _load_hf(data: dict):
    """Validate, then the loader's preflight of an HF policy's architecture (reads config.json)."""
    from rl_core.config.loader import check_model_architecture

    cfg = validate_dict(data)
    check_model_architecture(cfg)
    return cfg


def test_replay_with_a_dense_hf_policy_stops_at_recipe_load(tmp_path):
    import json

    on = {"trainer": {"router_replay": {"enabled": True}}}
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(RecipeError, match="trainer.router_replay.enabled.*model_type 'qwen2'"):
        _load_hf(_with(on, {"model": {"source": "hf", "path": str(tmp_path / "dense")}}))
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 4}))
    cfg = _load_hf(_with(on, {"model": {"source": "hf", "path": str(tmp_path / "moe")}}))
    assert cfg.trainer.router_replay.enabled
    with pytest.raises(RecipeError, match="generation.native.decode_path"):
        _load_hf(_with(on, {"model": {"source": "hf", "path": str(tmp_path / "moe")},
                                 "generation": {"native": {"decode_path": "static"}}}))
    # a path this machine cannot read (e.g. on the cluster) is checked when the model loads
    assert _load_hf(_with(on, {"model": {"source": "hf", "path": str(tmp_path / "elsewhere")}}))
