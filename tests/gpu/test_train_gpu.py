"""The trainer backends on one CUDA device (marked `gpu`, skipped without CUDA).

Each run is `rl_core.train.check_step` in its own process (two RL steps on a fixed batch of a
tiny Qwen2, then logprobs and the exported weights):
- fsdp2 (NCCL, world 1) in fp32 equals the torch backend; with bf16 mixed precision (bf16
  compute, fp32 reduce and master weights) it stays within bf16 tolerance;
- `trainer.fsdp.compile` gives the eager numbers;
- the torch backend's chunked logprobs (`trainer.logprob_chunk_tokens`) equal the full-logits path
  in fp32 (and within bf16 tolerance in bf16), and `trainer.compile` (compiled layers and the
  fused logprob path) gives the eager numbers in fp32, and within bf16 tolerance of bf16 eager in bf16;
- megatron (GPU path: Megatron's DDP and optimizer) equals the torch backend in fp32, and in
  bf16 with fp32 main weights stays within bf16 tolerance (both through the fused logprob path),
  and `trainer.megatron.compile` gives the eager numbers.
Megatron tests skip (with the reason) when megatron-core is not installed.
The throughput benchmark is `bench/train_step_gpu.py`.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from tests.helpers.trainers import assert_same_step, max_weight_diff, run_check, tiny_hf_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core is not installed")
CUDA = ("runtime.device=cuda",)
TIGHT, BF16 = 1e-4, 5e-2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_hf_dir(tmp_path_factory.mktemp("gpu_model") / "qwen2", "qwen2")


@pytest.fixture(scope="module")
def torch_fp32(model, tmp_path_factory):
    return run_check(model, tmp_path_factory.mktemp("ref"), "torch", 1, *CUDA)


def test_fsdp2_fp32_equals_torch(model, torch_fp32, tmp_path):
    ref, w_ref = torch_fp32
    got, w_got = run_check(model, tmp_path, "fsdp2", 1, *CUDA, "trainer.fsdp.mixed_precision=none")
    assert_same_step(ref, got, TIGHT)
    assert max_weight_diff(w_ref, w_got) < 1e-3


def test_fsdp2_bf16_mixed_precision_close_to_fp32(model, torch_fp32, tmp_path):
    ref, _ = torch_fp32
    got, _ = run_check(model, tmp_path, "fsdp2", 1, *CUDA, "trainer.fsdp.mixed_precision=bf16")
    assert_same_step(ref, got, BF16)
    assert got["steps"][0]["loss"] != ref["steps"][0]["loss"]  # bf16 compute really ran


def test_fsdp2_compile_equals_eager(model, tmp_path):
    sets = (*CUDA, "trainer.fsdp.mixed_precision=none")
    eager, w_eager = run_check(model, tmp_path, "fsdp2", 1, *sets)
    comp, w_comp = run_check(model, tmp_path, "fsdp2", 1, *sets, "trainer.fsdp.compile=true", timeout_s=600)
    assert_same_step(eager, comp, TIGHT)
    assert max_weight_diff(w_eager, w_comp) < 1e-3


def test_torch_chunked_logprobs_equal_full_logits(model, tmp_path):
    for dtype, tol in (("float32", TIGHT), ("bfloat16", BF16)):
        sets = (*CUDA, f"model.dtype={dtype}", "loss.kl_coef=0.1")
        full, w_full = run_check(model, tmp_path, "torch", 1, *sets, "trainer.logprob_chunk_tokens=0")
        chunked, w_chunked = run_check(model, tmp_path, "torch", 1, *sets, "trainer.logprob_chunk_tokens=7")
        assert_same_step(full, chunked, tol)
        lp_full, lp_chunked = (torch.tensor(r["logprobs"]) for r in (full, chunked))
        assert (lp_full - lp_chunked).abs().max().item() < (1e-4 if dtype == "float32" else 5e-2)
        assert max_weight_diff(w_full, w_chunked) < (1e-4 if dtype == "float32" else 1e-2)


def test_torch_compile_equals_eager(model, torch_fp32, tmp_path):
    ref, w_ref = torch_fp32
    got, w_got = run_check(model, tmp_path, "torch", 1, *CUDA, "trainer.compile=true", timeout_s=600)
    assert_same_step(ref, got, TIGHT)
    assert max_weight_diff(w_ref, w_got) < 1e-3


def test_torch_compile_bf16_close_to_eager_bf16(model, tmp_path):
    # against bf16 eager, not fp32: bf16 weights drop updates below their precision, so bf16 and fp32
    # part after the first step whatever the logprob path (measured on CPU: grad norm 2.36 vs 2.02)
    sets = (*CUDA, "model.dtype=bfloat16")
    eager, w_eager = run_check(model, tmp_path, "torch", 1, *sets)
    comp, w_comp = run_check(model, tmp_path, "torch", 1, *sets, "trainer.compile=true", timeout_s=600)
    assert_same_step(eager, comp, BF16)
    lp_eager, lp_comp = (torch.tensor(r["logprobs"]) for r in (eager, comp))
    # bf16 logits of |x| ~ 8 round in steps of 0.03-0.06, and the compiled matmuls sum in
    # another order: the bf16 tolerance of the generation tests (first H200 run: max 0.084).
    gaps = (lp_eager - lp_comp).abs()
    assert gaps.mean().item() < 0.05 and gaps.max().item() < 0.25
    assert max_weight_diff(w_eager, w_comp) < 1e-2


@needs_megatron
def test_megatron_compile_equals_eager(model, torch_fp32, tmp_path):
    ref, w_ref = torch_fp32
    got, w_got = run_check(model, tmp_path, "megatron", 1, *CUDA, "trainer.megatron.optimizer=megatron",
                           "trainer.megatron.mixed_precision=none", "trainer.megatron.compile=true", timeout_s=600)
    assert_same_step(ref, got, TIGHT)
    assert max_weight_diff(w_ref, w_got) < 1e-3


@needs_megatron
def test_megatron_fp32_with_megatron_optimizer_equals_torch(model, torch_fp32, tmp_path):
    ref, w_ref = torch_fp32
    got, w_got = run_check(model, tmp_path, "megatron", 1, *CUDA, "trainer.megatron.optimizer=megatron",
                           "trainer.megatron.mixed_precision=none")
    assert_same_step(ref, got, TIGHT)
    assert max_weight_diff(w_ref, w_got) < 1e-3


@needs_megatron
def test_megatron_bf16_close_to_fp32(model, torch_fp32, tmp_path):
    ref, _ = torch_fp32
    got, _ = run_check(model, tmp_path, "megatron", 1, *CUDA, "trainer.megatron.mixed_precision=bf16")
    assert_same_step(ref, got, BF16)


@needs_megatron
def test_megatron_eager_elementwise_equals_torch(model, torch_fp32, tmp_path):
    """`fused_elementwise: off` (Megatron's eager norms, rotary and SwiGLU) against the torch backend; the
    tests above run the default on CUDA, the fused path."""
    ref, w_ref = torch_fp32
    got, w_got = run_check(model, tmp_path, "megatron", 1, *CUDA, "trainer.megatron.optimizer=megatron",
                           "trainer.megatron.mixed_precision=none", "trainer.megatron.fused_elementwise=off")
    assert_same_step(ref, got, TIGHT)
    assert max_weight_diff(w_ref, w_got) < 1e-3


def test_megatron_fused_adamw_equals_torch_fused():
    """`rl_core.train.fused_adam.fused_adamw` turns Megatron's fallback AdamW (torch's default,
    multi-tensor; fsdp2's ShardLocalAdamW likewise) into torch's fused kernel: the same weights, bit for bit, as an AdamW built with
    `fused=True`, also after a state saved unfused (step counters on the host) is loaded."""
    from rl_core.train.fused_adam import fused_adamw

    torch.manual_seed(0)
    shapes = [(896, 64), (64,), (3, 5, 7)]
    start = [torch.randn(s, device="cuda") for s in shapes]
    grads = [[torch.randn(s, device="cuda") for s in shapes] for _ in range(3)]
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def run(make, steps=3):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = make(params)
        for g in grads[:steps]:
            for p, gi in zip(params, g):
                p.grad = gi.clone()
            opt.step()
        return params, opt

    def patched(params):
        opt = torch.optim.AdamW(params, **kw)
        fused_adamw(opt)
        assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
        return opt

    ref, _ = run(lambda ps: torch.optim.AdamW(ps, fused=True, **kw))
    got, _ = run(patched)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    # a state saved by the unfused optimizer after one step (step counters on the host), loaded, then
    # two more steps: fused, from the same moments, as an AdamW(fused=True) given those moments
    _, unfused = run(lambda ps: torch.optim.AdamW(ps, foreach=True, **kw), steps=1)
    saved = unfused.state_dict()
    assert not saved["state"][0]["step"].is_cuda

    def resumed_patched(params):
        opt = torch.optim.AdamW(params, **kw)
        opt.load_state_dict(copy.deepcopy(saved))  # loading keeps the given tensors, which the steps update
        assert not any(g["fused"] for g in opt.param_groups)  # the saved groups' options came back
        fused_adamw(opt)
        assert all(s["step"].is_cuda and s["step"].dtype == torch.float32 for s in opt.state.values())
        return opt

    def resumed_reference(params):
        opt = torch.optim.AdamW(params, fused=True, **kw)
        for i, p in enumerate(params):
            st = saved["state"][i]
            opt.state[p] = {"step": torch.tensor(float(st["step"]), device="cuda"),
                            "exp_avg": st["exp_avg"].clone(), "exp_avg_sq": st["exp_avg_sq"].clone()}
        return opt

    def two_more(make):
        params = [torch.nn.Parameter(t.clone()) for t in after_one]
        opt = make(params)
        for g in grads[1:3]:
            for p, gi in zip(params, g):
                p.grad = gi.clone()
            opt.step()
        return params

    after_one = [p.detach() for p in unfused.param_groups[0]["params"]]
    assert all(torch.equal(a, b) for a, b in zip(two_more(resumed_patched), two_more(resumed_reference)))
