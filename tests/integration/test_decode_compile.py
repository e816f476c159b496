"""`decode_compile` on the CPU: the static decode step with its layers run through
`torch.compile` (TorchInductor's C++ backend here, Triton on CUDA) gives the tokens and
logprobs of the uncompiled step, with the full-precision and the FP8 KV cache, and the
engine refuses it where there is no static step to compile. (The GPU test runs the same
comparison through CUDA graphs: tests/gpu/test_generation_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from rl_core.types import GenerationRequest, SamplingParams

from tests.helpers.engine_models import make_engine, prompts, run, tiny_model


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_compiled_static_decode_equals_uncompiled(kv):
    model = tiny_model("qwen2", 0, 0.1, max_positions=96)
    ps = prompts(6)
    reqs = [GenerationRequest(str(i), p, SamplingParams(temperature=1.0, max_tokens=12, seed=i) if i % 2 else
                              SamplingParams(greedy=True, max_tokens=10)) for i, p in enumerate(ps)]
    arrivals = [0, 0, 1, 2, 3, 3]
    plain = run(make_engine(model, max_batch_size=5, decode_path="static", kv_cache_dtype=kv), reqs, arrivals)
    engine = make_engine(model, max_batch_size=5, decode_path="static", decode_compile=True, kv_cache_dtype=kv)
    compiled = run(engine, reqs, arrivals)
    assert engine.decoder.compiled and engine.stats.static_decode_steps > 0
    for req in reqs:
        a, b = compiled[req.request_id], plain[req.request_id]
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_decode_compile_needs_a_static_step():
    model = tiny_model("qwen2", 0, 0.1, max_positions=96)
    with pytest.raises(ValueError, match="decode_compile"):
        make_engine(model, decode_path="eager", decode_compile=True)
    with pytest.raises(ValueError, match="decode_compile"):
        make_engine(model, decode_compile=True)  # auto on the CPU is eager
