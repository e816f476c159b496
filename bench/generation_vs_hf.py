"""Throughput of NativeEngine vs transformers `generate()` on the tiny recipe model.

Run: `.venv/bin/python bench/generation_vs_hf.py`. Prints tokens/s of the native engine
(eager decode path, and the static-shape decode path that CUDA graphs capture, run eagerly
here) and of transformers `generate()`, measured side by side in one run (best of 5), and
their ratios; timings are never test assertions. Shape: the `tiny` recipe model (Qwen2,
hidden 128, 2 layers, vocab 300), batch 128 of 6-token prompts, 8 new tokens, sampling at
temperature 1 (and greedy), 2 torch threads (`--threads`). The GPU counterpart is
bench/generation_gpu.py.
"""

from __future__ import annotations

import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rl_core.generation import EngineOptions, NativeEngine
from rl_core.types import GenerationRequest, SamplingParams

BATCH, PROMPT_LEN, NEW_TOKENS, VOCAB = 128, 6, 8, 300


def _model():
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      intermediate_size=512, vocab_size=VOCAB, max_position_embeddings=64,
                      tie_word_embeddings=True, initializer_range=0.3)
    return Qwen2ForCausalLM(cfg).eval()


def _best_of(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(greedy: bool = False, repeats: int = 5, decode_path: str = "eager", num_threads: int = 2) -> dict[str, float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        model = _model()
        prompts = torch.randint(0, VOCAB, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
        engine = NativeEngine(model.config, model.state_dict(),
                              EngineOptions(max_batch_size=BATCH, decode_path=decode_path))
        params = SamplingParams(greedy=greedy, temperature=1.0, max_tokens=NEW_TOKENS)
        counts = {}

        def native():
            for i, p in enumerate(prompts.tolist()):
                engine.add_request(GenerationRequest(str(i), p, params))
            n = 0
            while engine.has_work():
                n += sum(len(r.token_ids) for r in engine.step())
            counts["native"] = n

        def hf():
            with torch.no_grad():
                out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=not greedy,
                                     temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS,
                                     min_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=None)
            counts["hf"] = out[:, PROMPT_LEN:].numel()

        t_native, t_hf = _best_of(native, repeats), _best_of(hf, repeats)
    finally:
        torch.set_num_threads(threads)
    return {"native_tok_s": counts["native"] / t_native, "hf_tok_s": counts["hf"] / t_hf,
            "speedup": t_hf / t_native, "native_s": t_native, "hf_s": t_hf,
            "tokens": counts["native"], "hf_tokens": counts["hf"], "threads": num_threads}


def _report(name: str, m: dict[str, float]) -> str:
    return (f"{name}: native {m['native_tok_s']:,.0f} tok/s ({m['native_s'] * 1e3:.1f} ms), transformers "
            f"generate {m['hf_tok_s']:,.0f} tok/s ({m['hf_s'] * 1e3:.1f} ms), ratio {m['speedup']:.1f}x "
            f"[batch {BATCH}, prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens, {m['threads']} threads]")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="native engine vs transformers generate() on the tiny model (CPU)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for path in ("eager", "static"):
        for greedy in (False, True):
            name = f"{'greedy' if greedy else 'sampled'}, {path} decode"
            print(_report(name, measure(greedy, args.repeats, path, args.threads)))
