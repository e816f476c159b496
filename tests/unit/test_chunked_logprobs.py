"""The chunked logprob path (`rl_core.train.logprobs`) equals the full-logits reference, and
the trainer knobs around it (`trainer.logprob_chunk_tokens`, `trainer.compile`) are honoured
or refused with a recipe error.

Tolerances (fp32 on CPU): logprobs within 1e-5 absolute and parameter gradients within 1e-4
(measured ~1e-6 and ~1e-5: the chunk's matmul and log-sum-exp round differently from the
whole-vocabulary log_softmax); a wrong softmax gradient, a missed target or a dropped chunk
would be off by orders of magnitude. The backward pass is also checked against finite
differences in float64 (`gradcheck`).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config

from rl_core.config import apply_overrides, validate_dict
from rl_core.errors import RecipeError
from rl_core.train.logprobs import ChunkedHeadLogprobs, resolve_chunk_tokens, token_logprobs
from tests.helpers.trainers import VOCAB, assert_same_step, max_weight_diff, run_check, tiny_hf_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked_models")
    return {"untied": tiny_hf_dir(root / "untied", "qwen2", tied=False),
            "tied": tiny_hf_dir(root / "tied", "llama", tied=True)}


def _lp_and_grads(model, ids, mask, weights, temperature, chunk):
    model.zero_grad(set_to_none=True)
    lp = token_logprobs(model, ids, mask, temperature, chunk)
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["untied", "tied"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_gradients_equal_the_full_logits_path(models, kind, temperature):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(models[kind]), dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0  # a padded row
    weights = torch.randn(3, 11)  # a per-token upstream gradient, as a policy loss gives
    ref_lp, ref_grads = _lp_and_grads(model, ids, mask, weights, temperature, 0)
    assert (ref_lp[:, 0] == 0).all()
    for chunk in (1, 7, 30, 1000):  # 30 = 3 x 10 tokens exactly; 7 does not divide 30; 1000 = one chunk
        lp, grads = _lp_and_grads(model, ids, mask, weights, temperature, chunk)
        assert lp.shape == ref_lp.shape and lp.dtype == torch.float32
        assert (lp - ref_lp).abs().max().item() < 1e-5, chunk
        assert sorted(grads) == sorted(ref_grads)
        for name, g in grads.items():
            assert (g - ref_grads[name]).abs().max().item() < 1e-4, (chunk, name)


def test_chunked_head_backward_matches_finite_differences():
    torch.manual_seed(1)
    hidden = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(13, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (9,))
    for temperature, chunk in ((1.0, 4), (0.6, 9), (1.3, 2)):
        assert torch.autograd.gradcheck(lambda h, w, b: ChunkedHeadLogprobs.apply(h, w, b, targets, temperature, chunk),
                                        (hidden, weight, bias))
    full = torch.log_softmax((hidden @ weight.T + bias) / 0.6, -1).gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(ChunkedHeadLogprobs.apply(hidden, weight, bias, targets, 0.6, 4), full)


def test_torch_trainer_step_with_chunked_logprobs_equals_the_full_logits_step(models, tmp_path):
    """Two RL steps of the torch backend (a KL term too: reference logprobs take the same path)."""
    sets = ("trainer.microbatch_size=4", "loss.kl_coef=0.1")
    ref, w_ref = run_check(models["tied"], tmp_path, "torch", 1, *sets, "trainer.logprob_chunk_tokens=0")
    got, w_got = run_check(models["tied"], tmp_path, "torch", 1, *sets, "trainer.logprob_chunk_tokens=5")
    assert_same_step(ref, got, 1e-5)
    assert (torch.tensor(ref["logprobs"]) - torch.tensor(got["logprobs"])).abs().max().item() < 1e-5
    assert max_weight_diff(w_ref, w_got) < 1e-5


def test_chunk_size_is_checked_per_model():
    qwen = AutoConfig.for_model("qwen2")
    gpt2 = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16)
    assert resolve_chunk_tokens(0, qwen) == 0 and resolve_chunk_tokens(64, qwen) == 64
    assert resolve_chunk_tokens(0, gpt2) == 0
    with pytest.raises(RecipeError, match="trainer.logprob_chunk_tokens.*gpt2"):
        resolve_chunk_tokens(64, gpt2)


def test_torch_trainer_honours_the_knobs(models):
    from rl_core.train.torch_trainer import TorchTrainer

    cfg = validate_dict(apply_overrides({}, ["trainer.logprob_chunk_tokens=64", "trainer.compile=true"]))
    trainer = TorchTrainer(models["untied"], cfg.trainer)
    assert trainer.chunk_tokens == 64
    layers = list(trainer.model.model.layers)
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)  # nn.Module.compile, in place
    assert "model.layers.0.mlp.up_proj.weight" in trainer.export_weights()  # HF names unchanged
    default = TorchTrainer(models["untied"], validate_dict({}).trainer)
    assert default.chunk_tokens == 0  # full logits unless asked
    assert all(layer._compiled_call_impl is None for layer in default.model.model.layers)


@pytest.mark.parametrize("sets,field", [
    (["trainer.backend=fsdp2", "trainer.logprob_chunk_tokens=1024"], "trainer.logprob_chunk_tokens"),
    (["trainer.backend=megatron", "trainer.logprob_chunk_tokens=512"], "trainer.logprob_chunk_tokens"),
    (["trainer.backend=fsdp2", "trainer.compile=true"], "trainer.compile"),
    (["trainer.backend=megatron", "trainer.compile=true"], "trainer.compile"),
    (["trainer.logprob_chunk_tokens=-1"], "trainer.logprob_chunk_tokens"),
])
def test_knobs_are_refused_where_unsupported(sets, field):
    with pytest.raises(RecipeError) as info:
        validate_dict(apply_overrides({}, sets))
    assert field in str(info.value)
