"""Sequence packing on one CUDA device (marked `gpu`, skipped without CUDA): the CPU tests of
tests/unit/test_packing_step.py and test_packed_layout.py on the GPU paths.

- `varlen_attention` in bf16 takes torch's FlashAttention varlen kernels and equals causal
  attention of each sequence alone (fp32 reference, bf16 tolerance), gradients too; in fp32 the
  SDPA path, tightly;
- a packed HF forward's logprobs (full-logits, chunked and the compiled fused path) equal the
  padded ones, fp32 tightly and bf16 within bf16 tolerance;
- RL steps (`rl_core.train.check_step`): torch packed against padded in fp32 and bf16, compiled
  (`trainer.compile`) in bf16, under token budgets; fsdp2 (NCCL, world 1) with bf16 mixed
  precision under a budget; megatron (world 1) in fp32 and bf16 under a budget.
Tolerances as tests/gpu/test_train_gpu.py: fp32 1e-4, bf16 5e-2 relative for loss and gradient
norm, bf16 logprob gaps mean < 0.05 and max < 0.25, weights < 1e-2 (1e-3 in fp32).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rl_core.packing import PackedRows
from rl_core.train import varlen
from rl_core.train.logprobs import token_logprobs
from tests.helpers.trainers import assert_same_step, max_weight_diff, run_check, tiny_hf_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core is not installed")
CUDA = ("runtime.device=cuda",)
PACKED, PADDED = "trainer.packing=on", "trainer.packing=off"
TIGHT, BF16 = 1e-4, 5e-2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_hf_dir(tmp_path_factory.mktemp("gpu_packing") / "qwen2", "qwen2")


def ragged_mask(lengths: list[int], width: int | None = None) -> torch.Tensor:
    width = width or max(lengths)
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()


def per_sequence_attention(q, k, v, lengths):
    """Each sequence alone through SDPA in fp32 ([L, H, D] rows, grouped-query heads repeated)."""
    out, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = (t[start:start + n].float().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        out.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_varlen_attention_on_cuda(dtype):
    lengths = [37, 1, 300, 64, 129]
    g = torch.Generator(device="cuda").manual_seed(0)
    n = sum(lengths)
    q = torch.randn(n, 8, 64, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(n, 2, 64, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(n, 2, 64, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    rows = PackedRows.of(ragged_mask(lengths)).to("cuda")
    assert varlen.attention_path(q) == ("varlen" if dtype == torch.bfloat16 else "padded")
    got = varlen.varlen_attention(q, k, v, rows.cu_seqlens, rows.max_len)
    want = per_sequence_attention(q, k, v, lengths)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert (got.float() - want).abs().max().item() < tol
    w = torch.randn(got.shape, device="cuda", generator=g)
    grads = torch.autograd.grad((got.float() * w).sum(), (q, k, v))
    wants = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(grads, wants):
        # bf16 keeps 8 significant bits: its error scales with the gradient (2% of the largest), fp32 absolute
        scale = 2e-2 * b.abs().max().item() if dtype == torch.bfloat16 else 1e-4
        assert (a.float() - b).abs().max().item() < scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", [dict(), dict(chunk_tokens=16), dict(fused=True)], ids=["full", "chunked", "fused"])
def test_packed_logprobs_equal_padded_on_cuda(model, dtype, path):
    from transformers import AutoModelForCausalLM

    padded = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).cuda()
    packed = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).cuda()
    varlen.use_packed_attention(packed)
    mask = ragged_mask([40, 3, 64, 17, 64, 1])
    ids = (torch.randint(0, 96, mask.shape, generator=torch.Generator().manual_seed(1)) * mask).cuda()
    mask = mask.cuda()
    a = token_logprobs(padded, ids, mask, 0.7, **path)
    b = token_logprobs(packed, ids, mask, 0.7, packed=PackedRows.of(mask.cpu()).to("cuda"), **path)
    gaps = (a - b).float()[mask.bool()].abs()
    if dtype == torch.float32:
        assert gaps.max().item() < 1e-4
    else:
        assert gaps.mean().item() < 0.05 and gaps.max().item() < 0.25


def assert_close_runs(ref: tuple, got: tuple, dtype: str) -> None:
    (r, w_r), (g, w_g) = ref, got
    tight = dtype == "float32"
    assert_same_step(r, g, TIGHT if tight else BF16)
    for key in ("logprobs_initial", "logprobs"):
        gaps = (torch.tensor(r[key]) - torch.tensor(g[key])).abs()
        if tight:
            assert gaps.max().item() < 1e-4, key
        else:
            assert gaps.mean().item() < 0.05 and gaps.max().item() < 0.25, key
    assert max_weight_diff(w_r, w_g) < (1e-3 if tight else 1e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_packed_step_equals_padded_on_cuda(model, tmp_path, dtype):
    sets = (*CUDA, f"model.dtype={dtype}", "loss.kl_coef=0.1")
    ref = run_check(model, tmp_path, "torch", 1, *sets, PADDED)
    for extra in ((), ("trainer.max_tokens_per_microbatch=24",), ("trainer.logprob_chunk_tokens=7",)):
        got = run_check(model, tmp_path, "torch", 1, *sets, PACKED, *extra)
        assert_close_runs(ref, got, dtype)


def test_torch_compiled_packed_step_close_to_padded_bf16(model, tmp_path):
    sets = (*CUDA, "model.dtype=bfloat16")
    ref = run_check(model, tmp_path, "torch", 1, *sets, PADDED)
    got = run_check(model, tmp_path, "torch", 1, *sets, PACKED, "trainer.compile=true",
                    "trainer.max_tokens_per_microbatch=30", timeout_s=600)
    assert_close_runs(ref, got, "bfloat16")


def test_fsdp2_packed_step_equals_padded_on_cuda(model, tmp_path):
    sets = (*CUDA, "trainer.fsdp.mixed_precision=bf16")
    ref = run_check(model, tmp_path, "fsdp2", 1, *sets, PADDED)
    got = run_check(model, tmp_path, "fsdp2", 1, *sets, PACKED, "trainer.max_tokens_per_microbatch=24")
    assert_close_runs(ref, got, "bfloat16")


@needs_megatron
@pytest.mark.parametrize("precision", ["none", "bf16"])
def test_megatron_packed_step_equals_padded_on_cuda(model, tmp_path, precision):
    sets = (*CUDA, "trainer.megatron.optimizer=megatron", f"trainer.megatron.mixed_precision={precision}")
    ref = run_check(model, tmp_path, "megatron", 1, *sets, PADDED)
    got = run_check(model, tmp_path, "megatron", 1, *sets, PACKED, "trainer.max_tokens_per_microbatch=40")
    assert_close_runs(ref, got, "float32" if precision == "none" else "bfloat16")
