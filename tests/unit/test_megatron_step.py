"""The Megatron-core backend trains the same step as the torch backend, from the same HF weights.

Runs are `rl_core.train.check_step` in subprocesses (Megatron keeps process-global state):
Megatron's GPTModel (local layer spec, CPU workarounds, torch AdamW on Megatron's DDP
gradient buffers) against `TorchTrainer` on a tiny Qwen2 (GQA, q/k/v biases) or Llama.
Tolerances as for fsdp2: loss and gradient norm within 1e-5 relative, logprobs and
weights within 1e-4 (measured ~1e-7 and ~1e-5: Megatron's attention and cross entropy sum
in other orders).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl_core.train.check_step import synthetic_chunk
from tests.helpers.trainers import VOCAB, assert_same_flops, assert_same_step, max_weight_diff, run_check, tiny_hf_dir

REL, ABS = 1e-5, 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_models")
    return {"qwen2": tiny_hf_dir(root / "qwen2", "qwen2", tied=False),
            "llama_tied": tiny_hf_dir(root / "llama", "llama", tied=True)}


def test_megatron_matches_transformers_and_the_torch_step(models, tmp_path):
    """Before training: Megatron's logprobs equal transformers' on the same HF weights.
    Then two RL steps equal the torch backend's (loss, grad norm, logprobs, exported weights)."""
    ref, w_ref = run_check(models["qwen2"], tmp_path, "torch")
    got, w_got = run_check(models["qwen2"], tmp_path, "megatron")
    chunk = synthetic_chunk(VOCAB, 12, 0)
    model = AutoModelForCausalLM.from_pretrained(str(models["qwen2"])).eval()
    with torch.no_grad():
        logits = model(input_ids=chunk.input_ids, attention_mask=chunk.attention_mask).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, chunk.input_ids[:, 1:, None]).squeeze(-1)
    hf_lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], 1) * chunk.loss_mask
    assert (torch.tensor(got["logprobs_initial"]) - hf_lp).abs().max().item() < ABS
    assert_same_step(ref, got, REL)
    assert_same_flops(ref, got)  # FLOPs/MFU metrics as the torch backend reports them
    assert (torch.tensor(ref["logprobs"]) - torch.tensor(got["logprobs"])).abs().max().item() < ABS
    assert max_weight_diff(w_ref, w_got) < ABS


def test_megatron_local_attention_tied_llama_with_kl(models, tmp_path):
    sets = ("trainer.microbatch_size=2", "loss.kl_coef=0.1")
    ref, w_ref = run_check(models["llama_tied"], tmp_path, "torch", 1, *sets)
    got, w_got = run_check(models["llama_tied"], tmp_path, "megatron", 1, *sets, "trainer.megatron.attention=local")
    assert_same_step(ref, got, REL)
    assert_same_flops(ref, got)  # the KL term's reference passes counted as the torch trainer counts them
    assert max_weight_diff(w_ref, w_got) < ABS


@pytest.mark.parametrize("layout", ["tensor_parallel_2", "data_parallel_2"])
def test_two_process_megatron_matches_torch(models, tmp_path, layout):
    """TP=2 (heads, MLP and vocabulary split; grad norm summed over the TP group) and DP=2
    (Megatron DDP sums the ranks' gradients; rank 1 runs a dummy microbatch)."""
    sets = ("trainer.microbatch_size=1",)
    extra = ("trainer.megatron.tensor_model_parallel_size=2",) if layout == "tensor_parallel_2" else ()
    ref, w_ref = run_check(models["qwen2"], tmp_path, "torch", 1, *sets, num_samples=6)
    got, w_got = run_check(models["qwen2"], tmp_path, "megatron", 2, *sets, *extra, num_samples=6)
    assert got["world_size"] == 2
    assert_same_step(ref, got, REL)
    assert_same_flops(ref, got)  # TP ranks share their microbatches: counted once per data-parallel rank
    assert max_weight_diff(w_ref, w_got) < ABS


def test_megatron_fused_elementwise_matches_torch(models, tmp_path):
    """`fused_elementwise: on` (compiled RMSNorms and rotary embedding, Megatron's compiled SwiGLU;
    the default on CUDA) trains the same two steps as the torch backend, in the same tolerances."""
    ref, w_ref = run_check(models["qwen2"], tmp_path, "torch")
    got, w_got = run_check(models["qwen2"], tmp_path, "megatron", 1, "trainer.megatron.fused_elementwise=on")
    assert_same_step(ref, got, REL)
    assert (torch.tensor(ref["logprobs"]) - torch.tensor(got["logprobs"])).abs().max().item() < ABS
    assert max_weight_diff(w_ref, w_got) < ABS
