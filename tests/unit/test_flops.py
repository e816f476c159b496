"""FLOPs and MFU accounting against values written out by hand."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rl_core.algorithms.flops import (FlopsCounter, FlopsSpec, forward_flops, mfu, peak_flops_per_s,
                                      train_flops)
from rl_core.types import TrainChunk

SPEC = FlopsSpec(matmul_params=100, num_layers=2, attn_dim=8)


def test_train_flops_by_hand():
    # lengths 3 and 5: dense 6 * 100 * 8 = 4800 ; attention 12 * 2 * 8 * (9 + 25) = 6528
    assert train_flops([3, 5], SPEC) == 4800 + 6528
    # causal: 12 * 2 * 8 * (3*4/2 + 5*6/2) = 192 * 21 = 4032
    assert train_flops([3, 5], SPEC, causal=True) == 4800 + 4032
    assert forward_flops([3, 5], SPEC) == pytest.approx((4800 + 6528) / 3)
    assert train_flops([], SPEC) == 0.0


def test_chunk_counts_real_tokens_only():
    attn = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    c = TrainChunk(input_ids=torch.zeros(2, 5, dtype=torch.long), attention_mask=attn, loss_mask=torch.zeros(2, 5),
                   gen_logprobs=torch.zeros(2, 5), advantages=torch.zeros(2, 5), sample_mask=torch.ones(2),
                   start_versions=torch.zeros(2, dtype=torch.long))
    assert train_flops(c, SPEC) == train_flops([3, 5], SPEC)


def tiny(tied: bool):
    cfg = Qwen2Config(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=32, max_position_embeddings=32, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(cfg)


def test_spec_from_model_excludes_the_embedding_lookup_once():
    m = tiny(tied=False)
    total = sum(p.numel() for p in m.parameters())
    spec = FlopsSpec.from_model(m)
    assert spec.matmul_params == total - 50 * 16  # LM head counted, input table not
    assert (spec.num_layers, spec.attn_dim) == (2, 16)
    t = tiny(tied=True)  # the shared matrix is the LM head: counted once
    assert FlopsSpec.from_model(t).matmul_params == sum(p.numel() for p in {id(p): p for p in t.parameters()}.values())


def test_spec_of_a_mixture_of_experts_counts_the_routed_experts_only():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=50, num_local_experts=4, num_experts_per_tok=2)
    spec = FlopsSpec.from_model(MixtralForCausalLM(cfg))
    attn = 32 * 32 * 2 + 16 * 32 * 2  # q, o; k, v
    router, experts = 4 * 32, 4 * (128 * 32 + 32 * 64)  # gate; gate_up + down of 4 experts
    norms = 2 * 32
    per_layer = attn + router + experts // 2 + norms  # 2 of the 4 experts per token
    assert spec.matmul_params == 2 * per_layer + 32 + 50 * 32  # final norm, untied LM head (embedding excluded)


def test_counter_sums_every_optimizer_step_and_forward_passes():
    counter = FlopsCounter(SPEC)
    for _epoch in range(3):  # e.g. 3 PPO epochs over the same two sequences
        counter.add_train([3, 5])
    counter.add_forward([3, 5])  # reference logprobs
    assert counter.train == 3 * 11328 and counter.forward == pytest.approx(11328 / 3)
    m = counter.metrics(seconds=2.0, peak_flops_per_s=1e4, num_devices=2)
    assert m["flops/total"] == pytest.approx(3 * 11328 + 11328 / 3)
    assert m["perf/mfu"] == pytest.approx(m["flops/total"] / 2.0 / 2e4)
    assert "perf/mfu" not in counter.metrics(1.0, None)
    counter.reset()
    assert counter.total == 0.0


def test_mfu_and_peaks():
    assert mfu(1e12, 2.0, 1e12) == 0.5
    assert mfu(1e12, 0.0, 1e12) == 0.0
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0)
    assert peak_flops_per_s("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_per_s("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_per_s("NVIDIA H200") == 989e12
    assert peak_flops_per_s("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_per_s("Some CPU") is None
