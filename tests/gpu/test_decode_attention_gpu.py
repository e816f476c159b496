"""The fused decode-attention kernel on CUDA (marked `gpu`): one decode layer equals the torch
layer (float32 to rounding, bf16 within bf16 tolerance, positions across several key
blocks); the fused sampling kernels give `sample_plain`'s tokens and logprobs; the split-K projection kernels equal torch's matmul and add + norm; and engines with `decode_attention:
fused` (CUDA graphs, with and without `decode_compile`, with `overlap_steps`; the stack's projections
split-K or on torch's matmul) give the tokens and logprobs of the torch attention."""

from __future__ import annotations

import pytest
import torch

from rl_core.types import GenerationRequest, SamplingParams

from tests.helpers.decode_attention_check import check_gaps, compare
from tests.helpers.engine_models import make_engine, prompts, run, tiny_model
from tests.helpers.fused_mlp_check import CASES as MLP_CASES, QWEN, check as check_mlp, compare as compare_mlp
from tests.helpers.fused_sampling_check import CASES, check, compare as compare_sampling, compare_lm_head

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 16), (14, 2, 64), (4, 4, 128)])
def test_fused_decode_layer_equals_the_torch_layer(heads, kv_heads, head_dim):
    positions = (0, 1, 63, 64, 65, 130, 199, 255)
    check_gaps([compare("cuda", dt, heads, kv_heads, head_dim, positions) for dt in (torch.float32, torch.bfloat16)])


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
    from rl_core.generation.native import fused_stack

    monkeypatch.setattr(fused_stack, "SPLIT_K", mlp != "fused-no-split-k")  # read when the engine is built
    model = tiny_model("qwen2", 0, 0.3, max_positions=64).to("cuda", dtype)
    ps = prompts(12, seed=5)
    reqs = [GenerationRequest(str(i), p, SamplingParams(greedy=True, max_tokens=5 + i % 9) if i % 2 else
                              SamplingParams(temperature=0.8, max_tokens=4 + i % 11, seed=100 + i))
            for i, p in enumerate(ps)]
    arrivals = [0, 0, 0, 1, 2, 5, 5, 6, 9, 14, 14, 20]
    kw = dict(device="cuda", dtype=dtype, decode_path="graph", max_batch_size=5, decode_compile=compile,
              overlap_steps=overlap)
    ref = run(make_engine(model, **kw), reqs, arrivals)
    engine = make_engine(model, decode_attention="fused", decode_mlp=mlp.removesuffix("-no-split-k"), **kw)
    got = run(engine, reqs, arrivals)
    assert engine.decoder.fused_attention and engine.decoder.fused_mlp == mlp.startswith("fused")
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
    print(f"{dtype} compile={compile} overlap={overlap} mlp={mlp}: {shared}/{total} tokens shared, logprob gap "
          f"mean {gaps.mean().item():.2e} max {gaps.max().item():.2e}")
    if dtype == torch.float32:
        assert gaps.max().item() < 1e-4
    else:
        assert gaps.mean().item() < 0.05 and gaps.max().item() < 0.25 and shared >= 0.8 * total


def test_fused_kernel_graphs_survive_weight_updates():
    old, new = (tiny_model("qwen2", seed, 0.3, max_positions=64).to("cuda") for seed in (0, 1))
    reqs = [GenerationRequest(str(i), p, SamplingParams(greedy=True, max_tokens=10)) for i, p in enumerate(prompts(6))]
    engine = make_engine(old, device="cuda", decode_path="graph", decode_attention="fused")
    run(engine, reqs)
    engine.update_weights(1, new.state_dict())
    after = run(engine, [GenerationRequest("n" + r.request_id, r.prompt_ids, r.params) for r in reqs])
    fresh = run(make_engine(new, device="cuda", decode_path="eager"), reqs)
    assert all(after["n" + r.request_id].token_ids == fresh[r.request_id].token_ids for r in reqs)
