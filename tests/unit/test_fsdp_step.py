"""FSDP2 across processes gives the same RL step as the one-process torch trainer.

Each run is `rl_core.train.check_step`: two RL steps on one fixed synthetic batch streamed
as two chunks, then the batch's logprobs and the exported weights. The 2-process runs go
through torchrun (gloo on CPU), so the rendezvous, the rank-0 driver and the worker loop
are the real ones. Tolerances (fp32, 2 threads): loss and gradient norm within 1e-5
relative, logprobs and weights after the steps within 1e-4 absolute (measured: ~1e-7 and
~1e-6); a one-token shift or a wrong gradient scale would be off by orders of magnitude.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.trainers import assert_same_flops, assert_same_step, max_weight_diff, run_check, tiny_hf_dir

REL, ABS = 1e-5, 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_models")
    return {"untied": tiny_hf_dir(root / "untied", "qwen2", tied=False),
            "tied": tiny_hf_dir(root / "tied", "qwen2", tied=True)}


def _logprobs(result) -> torch.Tensor:
    return torch.tensor(result["logprobs"])


def assert_forward_pass_in_mfu(result) -> None:
    """check_step takes the batch's logprobs (a forward-only pass) before its first RL step: that
    step counts the pass's FLOPs (a third of one training pass over the same batch) and its
    seconds (MFU's time: FLOPs / flops/per_s, more than the step's own compute_s); the second
    step has no such pass."""
    s0, s1 = result["steps"]
    assert s0["flops_train"] == pytest.approx(s1["flops_train"], rel=1e-12)
    assert s0["flops_total"] - s1["flops_total"] == pytest.approx(s1["flops_train"] / 3, rel=1e-9)
    assert s0["flops_total"] / s0["flops_per_s"] > s0["compute_s"]
    assert s1["flops_total"] / s1["flops_per_s"] == pytest.approx(s1["compute_s"], rel=1e-9)


def test_two_process_fsdp2_step_matches_one_process_torch(models, tmp_path):
    ref, w_ref = run_check(models["untied"], tmp_path, "torch")
    got, w_got = run_check(models["untied"], tmp_path, "fsdp2", 2)
    assert got["world_size"] == 2 and got["source"] == "torchrun" and got["version"] == 2
    assert_same_step(ref, got, REL)
    assert_same_flops(ref, got)  # FLOPs/MFU metrics: both ranks' microbatches, counted once
    assert_forward_pass_in_mfu(ref)
    assert_forward_pass_in_mfu(got)
    assert ref["steps"][0]["loss"] != ref["steps"][1]["loss"]  # the first step changed the weights
    assert (_logprobs(ref) - _logprobs(got)).abs().max().item() < ABS
    assert max_weight_diff(w_ref, w_got) < ABS


def test_fsdp2_hsdp_tied_kl_and_uneven_microbatches(models, tmp_path):
    """Tied embeddings, a KL term (a sharded reference model), microbatches of 1 over 3 samples
    per chunk (rank 1 runs a dummy microbatch) and 2 replicas (HSDP mesh 2 x 1)."""
    sets = ("trainer.microbatch_size=1", "loss.kl_coef=0.1")
    ref, w_ref = run_check(models["tied"], tmp_path, "torch", 1, *sets, num_samples=6)
    got, w_got = run_check(models["tied"], tmp_path, "fsdp2", 2, *sets,
                           "trainer.fsdp.data_parallel_replicate_size=2", num_samples=6)
    assert_same_step(ref, got, REL)
    assert_same_flops(ref, got)  # the KL term's reference passes counted as the torch trainer counts them
    assert "lm_head.weight" in w_got and "model.embed_tokens.weight" in w_got
    assert torch.equal(w_got["lm_head.weight"], w_got["model.embed_tokens.weight"])
    assert max_weight_diff(w_ref, w_got) < ABS


def test_fsdp2_counts_empty_sequences_like_the_torch_trainer(models, tmp_path):
    """`loss.empty_sequences: zero` with excluded samples and microbatches of one sample: a rank's
    microbatch without a trained token still adds its sequence to the normaliser."""
    sets = ("trainer.microbatch_size=1", "loss.aggregation=sequence", "loss.empty_sequences=zero")
    ref, w_ref = run_check(models["untied"], tmp_path, "torch", 1, *sets, num_samples=6, mask_every=3)
    whole, _ = run_check(models["untied"], tmp_path, "torch", 1, "trainer.microbatch_size=6", *sets[1:],
                         num_samples=6, mask_every=3)
    assert_same_step(whole, ref, REL)  # one microbatch or six (two of them without a trained token): one step
    got, w_got = run_check(models["untied"], tmp_path, "fsdp2", 2, *sets, num_samples=6, mask_every=3)
    assert_same_step(ref, got, REL)
    assert max_weight_diff(w_ref, w_got) < ABS


def test_fsdp2_layers_in_one_unit_match_one_process_torch(models, tmp_path):
    """`trainer.fsdp.layers_per_unit` at the layer count (both layers one FSDP unit), clipping
    active (`max_grad_norm` below the gradient norm): the same step as the torch trainer."""
    sets = ("trainer.max_grad_norm=0.05",)
    ref, w_ref = run_check(models["untied"], tmp_path, "torch", 1, *sets)
    got, w_got = run_check(models["untied"], tmp_path, "fsdp2", 2, *sets, "trainer.fsdp.layers_per_unit=2")
    assert all(s["grad_norm"] > 0.05 for s in ref["steps"])  # the clip scaled the gradients
    assert_same_step(ref, got, REL)
    assert (_logprobs(ref) - _logprobs(got)).abs().max().item() < ABS
    assert max_weight_diff(w_ref, w_got) < ABS
