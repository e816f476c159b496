"""Shared by the native-engine unit tests: seeded tiny Qwen2/Llama models, engines over them,
prompts, a step loop with arrivals, and transformers' reference logprobs."""

from __future__ import annotations

from typing import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rl_core.generation import EngineOptions, NativeEngine
from rl_core.types import SamplingParams

VOCAB = 100


def tiny_model(arch: str = "qwen2", seed: int = 0, init: float = 0.3, max_positions: int = 64):
    """Seeded random model; init std 0.3 with perturbed norms and biases gives diverse greedy
    outputs (and very sharp attention, which FP8 keys cannot resolve: FP8 tests use 0.1)."""
    torch.manual_seed(seed)
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=VOCAB, intermediate_size=128, max_position_embeddings=max_positions,
                  initializer_range=init)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, rope_theta=1000.0, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, rope_theta=500.0, attention_bias=True,
                                             **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def make_engine(model, **kwargs) -> NativeEngine:
    kwargs.setdefault("max_batch_size", 8)
    return NativeEngine(model.config, model.state_dict(), EngineOptions(**kwargs))


def prompts(n: int, seed: int = 1, lengths=(3, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (s,), generator=g).tolist() for s in sizes]


def greedy(max_tokens=8, **kw) -> SamplingParams:
    return SamplingParams(greedy=True, max_tokens=max_tokens, **kw)


def run(engine: NativeEngine, requests, arrivals=None, each_step: Callable | None = None,
        max_steps: int = 2000) -> dict:
    """Step until done; requests[i] is added before step arrivals[i] (default 0)."""
    arrivals = arrivals or [0] * len(requests)
    results, step = {}, 0
    while len(results) < len(requests):
        for req, at in zip(requests, arrivals):
            if at == step:
                engine.add_request(req)
        for r in engine.step():
            results[r.request_id] = r
        if each_step is not None:
            each_step(engine)
        step += 1
        assert step < max_steps
    return results


def full_logprobs(model, prompt, tokens, temperature=1.0) -> torch.Tensor:
    """transformers' log_softmax(logits / T) of each completion token given its prefix."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp[len(prompt) - 1: -1].gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
