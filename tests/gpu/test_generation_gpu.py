"""NativeEngine on CUDA (marked `gpu`, skipped without a GPU): fp32 agrees with
transformers exactly as on CPU, bf16 stays close to transformers' bf16.

As a script it also prints the engine's throughput against transformers `generate()` at
Qwen2.5-0.5B shapes (random weights, bf16): `python tests/unit/test_generation_gpu.py`.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rl_core.generation import NativeEngine
from rl_core.types import GenerationRequest, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
VOCAB = 100


def tiny_model(arch: str, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=VOCAB, intermediate_size=128, max_position_embeddings=64, initializer_range=0.3)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    return model.to("cuda", dtype).eval()


def generate_all(engine, requests, arrivals=None):
    arrivals = arrivals or [0] * len(requests)
    results, step = {}, 0
    while len(results) < len(requests):
        for req, at in zip(requests, arrivals):
            if at == step:
                engine.add_request(req)
        results.update({r.request_id: r for r in engine.step()})
        step += 1
    return results


def prompts(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(s),), generator=g).tolist() for s in torch.randint(3, 12, (n,), generator=g)]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_cuda_fp32_matches_transformers(arch):
    model = tiny_model(arch, torch.float32)
    engine = NativeEngine(model.config, model.state_dict(), device="cuda", max_batch_size=8)
    ids = torch.randint(0, VOCAB, (3, 20), device="cuda")
    with torch.no_grad():
        ref = model(ids).logits
    assert (engine.model.sequence_logits(ids) - ref).abs().max().item() < 1e-4
    ps = prompts(6)
    reqs = [GenerationRequest(str(i), p, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=10, seed=i))
            for i, p in enumerate(ps)]
    out = generate_all(engine, reqs, arrivals=[0, 0, 1, 2, 2, 5])
    for req in reqs:
        res = out[req.request_id]
        seq = torch.tensor([req.prompt_ids + res.token_ids], device="cuda")
        with torch.no_grad():
            lp = torch.log_softmax(model(seq).logits[0].float() / 0.7, dim=-1)
        want = lp[len(req.prompt_ids) - 1:-1].gather(1, seq[0, len(req.prompt_ids):, None]).squeeze(1)
        assert (torch.tensor(res.logprobs, device="cuda") - want).abs().max().item() < 1e-4
    alone = generate_all(NativeEngine(model.config, model.state_dict(), device="cuda", max_batch_size=1), reqs[3:4])
    assert alone["3"].token_ids == out["3"].token_ids  # a seeded request is batch-invariant


def test_cuda_bf16_tracks_transformers_bf16():
    model = tiny_model("qwen2", torch.bfloat16)
    engine = NativeEngine(model.config, model.state_dict(), device="cuda", dtype=torch.bfloat16, max_batch_size=8)
    ps = prompts(8)
    reqs = [GenerationRequest(str(i), p, SamplingParams(greedy=True, max_tokens=12)) for i, p in enumerate(ps)]
    out = generate_all(engine, reqs, arrivals=[0, 0, 0, 1, 1, 2, 3, 3])
    gaps = []
    for req in reqs:
        res = out[req.request_id]
        seq = torch.tensor([req.prompt_ids + res.token_ids], device="cuda")
        with torch.no_grad():
            lp = torch.log_softmax(model(seq).logits[0].float(), dim=-1)
        want = lp[len(req.prompt_ids) - 1:-1].gather(1, seq[0, len(req.prompt_ids):, None]).squeeze(1)
        gaps.append((torch.tensor(res.logprobs, device="cuda") - want).abs())
    gaps = torch.cat(gaps)
    print(f"bf16 logprob gap vs transformers: mean {gaps.mean().item():.4f} max {gaps.max().item():.4f}")
    assert gaps.mean().item() < 0.05 and gaps.max().item() < 0.5


# ---------------------------------------------------------------------- benchmark (script only)


def benchmark(batch: int = 256, prompt_len: int = 64, new_tokens: int = 256) -> None:
    """Engine vs transformers generate at Qwen2.5-0.5B shapes, random bf16 weights."""
    cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                      tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    prompts_t = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device="cuda")
    engine = NativeEngine(cfg, model.state_dict(), device="cuda", dtype=torch.bfloat16, max_batch_size=batch,
                          max_seq_len=prompt_len + new_tokens + 8, eos_token_ids=[])

    def native():
        for i, p in enumerate(prompts_t.tolist()):
            engine.add_request(GenerationRequest(str(i), p, SamplingParams(temperature=1.0, max_tokens=new_tokens)))
        n = 0
        while engine.has_work():
            n += sum(len(r.token_ids) for r in engine.step())
        torch.cuda.synchronize()
        return n

    def hf():
        with torch.no_grad():
            out = model.generate(prompts_t, attention_mask=torch.ones_like(prompts_t), do_sample=True,
                                 temperature=1.0, top_k=None, top_p=None, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
        torch.cuda.synchronize()
        return out[:, prompt_len:].numel()

    for name, fn in (("native", native), ("transformers", hf)):
        fn()  # warm-up
        start = time.perf_counter()
        n = fn()
        elapsed = time.perf_counter() - start
        print(f"{name}: {n} tokens in {elapsed:.2f} s = {n / elapsed:,.0f} tok/s "
              f"[batch {batch}, prompt {prompt_len}, {new_tokens} new, bf16, Qwen2.5-0.5B shapes]")
    steps = list(engine.stats.trace)[-new_tokens:]
    decode = sorted(r.duration_s for r in steps if r.num_tokens == batch)
    if decode:
        print(f"native decode step: median {decode[len(decode) // 2] * 1e3:.2f} ms for {batch} rows")


if __name__ == "__main__":
    benchmark()
