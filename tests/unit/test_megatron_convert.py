"""HF <-> Megatron-core weight conversion (pure functions): exact round trips, the fused QKV
head interleave and gate/up fusion checked against hand-built tensors, tensor-parallel
split/merge, and clear errors for what cannot be converted."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, Qwen2Config

from rl_core.train.megatron_convert import (check_tensor_parallel, hf_to_megatron, megatron_to_hf,
                                            merge_tensor_parallel, shape_from_hf, split_tensor_parallel)


def _config(arch: str, tied: bool):
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=40,
                  intermediate_size=48, max_position_embeddings=32, tie_word_embeddings=tied)
    return Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)


def _random_hf(cfg) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("qwen2", True), ("llama", False)])
def test_round_trip_is_exact(arch, tied):
    cfg = _config(arch, tied)
    shape = shape_from_hf(cfg)
    hf = _random_hf(cfg)
    mg = hf_to_megatron(hf, shape)
    assert ("output_layer.weight" in mg) is (not tied)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mg) is (arch == "qwen2")
    back = megatron_to_hf(mg, shape)
    assert sorted(back) == sorted(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_qkv_is_grouped_by_kv_head_and_fc1_is_gate_then_up():
    """4 query heads, 2 kv heads, head dim 8: Megatron rows are [q0 q1 k0 v0 | q2 q3 k1 v1]."""
    cfg = _config("qwen2", False)
    shape = shape_from_hf(cfg)
    hf = _random_hf(cfg)
    d = shape.head_dim
    p = "model.layers.0."
    q, k, v = (hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
    expected = torch.cat([q[0:2 * d], k[0:d], v[0:d], q[2 * d:4 * d], k[d:2 * d], v[d:2 * d]])
    mg = hf_to_megatron(hf, shape)
    assert torch.equal(mg["decoder.layers.0.self_attention.linear_qkv.weight"], expected)
    qb, kb, vb = (hf[p + f"self_attn.{n}_proj.bias"] for n in "qkv")
    assert torch.equal(mg["decoder.layers.0.self_attention.linear_qkv.bias"],
                       torch.cat([qb[:2 * d], kb[:d], vb[:d], qb[2 * d:], kb[d:], vb[d:]]))
    assert torch.equal(mg["decoder.layers.0.mlp.linear_fc1.weight"],
                       torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]))
    assert torch.equal(mg["decoder.layers.0.pre_mlp_layernorm.weight"], hf[p + "post_attention_layernorm.weight"])


def test_tensor_parallel_split_and_merge():
    cfg = _config("qwen2", False)
    shape = shape_from_hf(cfg)
    mg = hf_to_megatron(_random_hf(cfg), shape)
    check_tensor_parallel(shape, 2)
    shards = [split_tensor_parallel(mg, 2, r) for r in range(2)]
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert shards[0][qkv].shape[0] == mg[qkv].shape[0] // 2  # one whole query group per rank
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    ffn = shape.ffn_hidden_size
    assert torch.equal(shards[1][fc1], torch.cat([mg[fc1][ffn // 2:ffn], mg[fc1][ffn + ffn // 2:]]))
    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    assert shards[0][proj].shape == (shape.hidden_size, shape.hidden_size // 2)
    merged = merge_tensor_parallel(shards)
    for k in mg:
        assert torch.equal(merged[k], mg[k]), k


def test_unconvertible_models_are_named():
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        shape_from_hf(GPT2Config())
    with pytest.raises(ValueError, match="attention_bias"):
        shape_from_hf(LlamaConfig(attention_bias=True))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tensor_parallel(shape_from_hf(_config("qwen2", False)), 4)


def test_make_trainer_preflight_names_the_recipe_field(tmp_path):
    from rl_core.config import apply_overrides, validate_dict
    from rl_core.errors import RecipeError
    from rl_core.train import check_megatron_model

    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40).save_pretrained(tmp_path / "gpt2")
    cfg = validate_dict(apply_overrides({}, ["trainer.backend=megatron"]))
    with pytest.raises(RecipeError, match="`trainer.backend` got 'megatron'.*model_type 'gpt2'.*fsdp2"):
        check_megatron_model(cfg, tmp_path / "gpt2")
    _config("qwen2", False).save_pretrained(tmp_path / "qwen2")
    tp4 = validate_dict(apply_overrides({}, ["trainer.backend=megatron",
                                             "trainer.megatron.tensor_model_parallel_size=4"]))
    with pytest.raises(RecipeError, match="`trainer.megatron.tensor_model_parallel_size` got 4.*num_key_value_heads"):
        check_megatron_model(tp4, tmp_path / "qwen2")
    check_megatron_model(cfg, tmp_path / "qwen2")
