"""The fused logprob path (`rl_core.train.logprobs.FusedLogprobs`, selected by `trainer.compile` /
`trainer.fsdp.compile`) equals the full-logits reference: logprobs and gradients on real tiny
models (fp32, CPU: the same functions the GPU compiles, run eagerly; within 1e-5 / 1e-4 as the
chunked path's test), a float64 finite-difference check of its backward, and compiled (CPU
inductor) against eager. The GPU tests compare `trainer.compile` with eager on an H200."""

from __future__ import annotations

import pytest
import torch

from rl_core.train.logprobs import FusedLogprobs, token_logprobs
from tests.helpers.trainers import VOCAB, tiny_hf_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("fused_models")
    return {k: AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir(root / k, arch, tied=tied)))
            for k, arch, tied in (("untied", "qwen2", False), ("tied", "llama", True))}


def _lp_and_grads(model, ids, mask, weights, temperature, fused):
    model.zero_grad(set_to_none=True)
    lp = token_logprobs(model, ids, mask, temperature, 0, fused=fused)
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["untied", "tied"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_logprobs_and_gradients_equal_the_reference_path(models, kind, temperature):
    torch.manual_seed(0)
    model = models[kind]
    ids = torch.randint(0, VOCAB, (3, 11))
    mask = torch.ones_like(ids)
    mask[2, :4] = 0  # a left-padded row
    weights = torch.randn(3, 11)
    ref_lp, ref_g = _lp_and_grads(model, ids, mask, weights, temperature, fused=False)
    lp, g = _lp_and_grads(model, ids, mask, weights, temperature, fused=True)
    assert lp.shape == ref_lp.shape and lp.dtype == ref_lp.dtype and torch.all(lp[:, 0] == 0)
    assert (lp - ref_lp).abs().max() < 1e-5
    assert ref_g.keys() == g.keys()
    for name in ref_g:
        assert (g[name] - ref_g[name]).abs().max() < 1e-4, name


def test_fused_backward_matches_finite_differences():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 13, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (2, 5))
    assert torch.autograd.gradcheck(lambda z: FusedLogprobs.apply(z, targets, 0.7, False), (logits,))
    want = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(FusedLogprobs.apply(logits, targets, 0.7, False), want, atol=1e-12)


def test_compiled_kernels_equal_the_eager_ones():
    torch.manual_seed(2)
    logits = torch.randn(2, 7, 50, dtype=torch.float32).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 50, (2, 7))
    g = torch.randn(2, 7)
    out = {}
    for compiled in (False, True):
        logits.grad = None
        lp = FusedLogprobs.apply(logits, targets, 0.7, compiled)
        (lp * g).sum().backward()
        out[compiled] = (lp.detach(), logits.grad.clone())
    assert out[True][1].dtype == torch.bfloat16  # the gradient is written in the logits' dtype
    assert (out[True][0] - out[False][0]).abs().max() < 1e-5
    assert (out[True][1].float() - out[False][1].float()).abs().max() < 1e-2  # bf16 rounding of the result
