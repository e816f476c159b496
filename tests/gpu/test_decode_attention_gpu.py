"""The fused decode-attention kernel on CUDA (marked `gpu`): one decode layer equals the torch
layer (float32 to rounding, bf16 within bf16 tolerance, positions across several key
blocks), on a cache in the model dtype and on an FP8 cache (whose bytes the kernel writes as
`quantize_fp8` does: saturation, values below e4m3's normal range, ties; FP8 engines on CUDA
graphs against the torch attention's, and after a weight update, which re-calibrates the
scales in place under the captured graphs); the fused sampling kernels give `sample_plain`'s tokens and logprobs; the split-K projection kernels equal torch's matmul and add + norm; and engines with `decode_attention:
fused` (CUDA graphs, with and without `decode_compile`, with `overlap_steps`; the stack's projections
split-K or on torch's matmul) give the tokens and logprobs of the torch attention."""

from __future__ import annotations

import pytest
import torch

from rl_core.types import GenerationRequest, SamplingParams

from tests.helpers.decode_attention_check import check_engine_fp8, check_fp8_gaps, check_fp8_kernel, check_gaps, compare
from tests.helpers.decode_attention_check import compare_fp8_kernel, engine_fp8, large_step_tile
from tests.helpers.engine_models import make_engine, prompts, run, tiny_model
from tests.helpers.fused_mlp_check import CASES as MLP_CASES, QWEN, check as check_mlp, compare as compare_mlp
from tests.helpers.fused_sampling_check import CASES, check, compare as compare_sampling, compare_lm_head

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 16), (14, 2, 64), (4, 4, 128)])
def test_fused_decode_layer_equals_the_torch_layer(heads, kv_heads, head_dim):
    positions = (0, 1, 63, 64, 65, 130, 199, 255)
    check_gaps([compare("cuda", dt, heads, kv_heads, head_dim, positions) for dt in (torch.float32, torch.bfloat16)])
    with large_step_tile():  # the kernel at the tile of steps above decode_attention.SMALL_ROWS rows
        check_gaps([compare("cuda", dt, heads, kv_heads, head_dim, positions) for dt in (torch.float32, torch.bfloat16)])
    check_fp8_gaps([compare("cuda", dt, heads, kv_heads, head_dim, positions, fp8=True)
                    for dt in (torch.float32, torch.bfloat16)])


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 32), (14, 2, 64), (4, 4, 128)])
def test_fused_kernel_writes_the_fp8_bytes_of_quantize_fp8(heads, kv_heads, head_dim):
    check_fp8_kernel([compare_fp8_kernel("cuda", dt, heads, kv_heads, head_dim, (0, 1, 63, 64, 130, 159))
                      for dt in (torch.float32, torch.bfloat16, torch.float16)])


def test_fused_sampling_equals_sample_plain():
    check([compare_sampling("cuda", dt, v, n) for dt, v, n in CASES + ((torch.bfloat16, 151936, 64),)])


def test_fused_lm_head_sampling_equals_sample_packed():
    # bf16 on the GPU (the kernel's TMA loads); the Qwen2.5-0.5B head at 64 and 256 rows among them
    check([compare_lm_head("cuda", torch.bfloat16, v, n, hid) for v, n, hid in
           ((1280, 19, 64), (3001, 5, 128), (151936, 64, 896), (151936, 256, 896))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gate_up_silu_equals_the_eager_mlp(dtype):
    for case in MLP_CASES + (QWEN,):
        check_mlp(dtype, compare_mlp("cuda", dtype, *case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_projection_and_add_norm_equal_torch(dtype):
    from tests.helpers.split_k_check import CASES as SPLIT_K_CASES, QWEN as SPLIT_K_QWEN, check as check_split_k
    from tests.helpers.split_k_check import compare as compare_split_k

    for case in SPLIT_K_CASES + SPLIT_K_QWEN:
        check_split_k(dtype, compare_split_k("cuda", dtype, *case))


@pytest.mark.parametrize("mlp", ["torch", "fused", "fused-no-split-k"])
@pytest.mark.parametrize("compile, overlap", [(False, False), (True, False), (True, True)],
                         ids=["graphs", "compiled-graphs", "compiled-graphs-overlap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engines_with_the_fused_kernel_match_torch_attention(dtype, compile, overlap, mlp, monkeypatch):
    _engines_match(dtype, compile, overlap, mlp, monkeypatch)


@pytest.mark.parametrize("mlp", ["torch", "fused"])
@pytest.mark.parametrize("compile, overlap", [(False, False), (True, True)], ids=["graphs", "compiled-graphs-overlap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_engines_with_the_fused_kernel_match_torch_attention(dtype, compile, overlap, mlp, monkeypatch):
    _engines_match(dtype, compile, overlap, mlp, monkeypatch, kv_cache_dtype="fp8_e4m3")


def test_fp8_engines_on_the_static_path_match_torch_attention():
    for dtype in (torch.float32, torch.bfloat16):
        check_engine_fp8(engine_fp8("cuda", dtype), dtype)


def _engines_match(dtype, compile, overlap, mlp, monkeypatch, kv_cache_dtype="auto"):
    from rl_core.generation.native import fused_stack

    monkeypatch.setattr(fused_stack, "SPLIT_K", mlp != "fused-no-split-k")  # read when the engine is built
    fp8 = kv_cache_dtype == "fp8_e4m3"
    model = tiny_model("qwen2", 0, 0.1 if fp8 else 0.3, max_positions=64).to("cuda", dtype)  # 0.1: see tiny_model
    ps = prompts(12, seed=5)
    reqs = [GenerationRequest(str(i), p, SamplingParams(greedy=True, max_tokens=5 + i % 9) if i % 2 else
                              SamplingParams(temperature=0.8, max_tokens=4 + i % 11, seed=100 + i))
            for i, p in enumerate(ps)]
    arrivals = [0, 0, 0, 1, 2, 5, 5, 6, 9, 14, 14, 20]
    kw = dict(device="cuda", dtype=dtype, decode_path="graph", max_batch_size=5, decode_compile=compile,
              overlap_steps=overlap, kv_cache_dtype=kv_cache_dtype)
    ref = run(make_engine(model, **kw), reqs, arrivals)
    engine = make_engine(model, decode_attention="fused", decode_mlp=mlp.removesuffix("-no-split-k"), **kw)
    got = run(engine, reqs, arrivals)
    assert engine.decoder.fused_attention and engine.decoder.fused_mlp == mlp.startswith("fused")
    assert engine.cache.fp8 == fp8
    assert engine.decoder._stack.split_k == (mlp != "fused-no-split-k")
    assert engine.decoder.replays > 0
    shared = total = 0
    gaps = []
    for req in reqs:
        a, b = got[req.request_id], ref[req.request_id]
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                 min(len(a.token_ids), len(b.token_ids)))
        if dtype == torch.float32:
            assert a.token_ids == b.token_ids
        shared, total = shared + n, total + len(b.token_ids)
        gaps.append((torch.tensor(a.logprobs[:n]) - torch.tensor(b.logprobs[:n])).abs())
    gaps = torch.cat(gaps)
    print(f"{dtype} kv={kv_cache_dtype} compile={compile} overlap={overlap} mlp={mlp}: {shared}/{total} tokens shared, logprob gap "
          f"mean {gaps.mean().item():.2e} max {gaps.max().item():.2e}")
    if dtype == torch.float32:
        assert gaps.max().item() < 1e-4
    else:
        assert gaps.mean().item() < 0.05 and gaps.max().item() < 0.25 and shared >= 0.8 * total


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_fused_kernel_graphs_survive_weight_updates(kv_cache_dtype):
    """With an FP8 cache the update also sets new scales (`KVCache.set_scales`, in place; here the
    fresh engine's, calibrated from the new weights, so that both run under the same ones): the
    captured graphs must read them (the kernel loads them from device memory)."""
    fp8 = kv_cache_dtype == "fp8_e4m3"
    old, new = (tiny_model("qwen2", seed, 0.1 if fp8 else 0.3, max_positions=64).to("cuda") for seed in (0, 1))
    reqs = [GenerationRequest(str(i), p, SamplingParams(greedy=True, max_tokens=10)) for i, p in enumerate(prompts(6))]
    kw = dict(device="cuda", kv_cache_dtype=kv_cache_dtype)
    engine = make_engine(old, decode_path="graph", decode_attention="fused", **kw)
    run(engine, reqs)
    fresh_engine = make_engine(new, decode_path="eager", **kw)
    scales = (fresh_engine.cache.k_scale.clone(), fresh_engine.cache.v_scale.clone()) if fp8 else None
    if fp8:
        assert not torch.equal(scales[0], engine.cache.k_scale) and not torch.equal(scales[1], engine.cache.v_scale)
    engine.update_weights(1, new.state_dict(), kv_scales=scales)
    after = run(engine, [GenerationRequest("n" + r.request_id, r.prompt_ids, r.params) for r in reqs])
    fresh = run(fresh_engine, reqs)
    assert all(after["n" + r.request_id].token_ids == fresh[r.request_id].token_ids for r in reqs)
