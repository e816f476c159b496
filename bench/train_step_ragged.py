"""The ragged long-tail batch of `bench/train_step_gpu.py --ragged` and its one table.

An RL step's completions range from a few tokens to the length cap. The batch: `n` samples,
prompts uniform in [cap/64, cap/16], completions log-normal (median cap/20, sigma 1) cut at the
cap, one sample in 16 truncated at the cap (seeded: every variant trains the same tokens).
Modes (`...+ragged+MODE`), the same samples and step: `padded` (`trainer.microbatch_size`
consecutive samples padded to their longest, as many as the token budget holds at the cap:
the trainers before packing), `sorted` (padded, cut by `trainer.max_tokens_per_microbatch`
after sorting by length), `packed` (`trainer.packing: on`, the same budget), `packed-sdpa`
(packed, attention through the `padded` SDPA path of rl_core.train.varlen instead of the
FlashAttention varlen kernels: what the kernel choice is worth). Useful work counts real tokens
only: `model_flops` (PaLM appendix B) with each sample's own length as T; "processed" tokens
are those the model ran, padding included. Does not own: timing steps (train_step_gpu.py).
"""

from __future__ import annotations

import math
import statistics

RAGGED_MODES = ("padded", "sorted", "packed", "packed-sdpa")


def model_flops(shape: dict, lengths: list[int]) -> float:
    """Training FLOPs of sequences of these lengths (Chowdhery et al. 2022, PaLM, appendix B):
    per token 6 N + 12 L H Q T, T the token's sequence length (full attention matrix counted)."""
    h, layers, heads, kv = (shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "num_key_value_heads"))
    d = h // heads
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * shape["intermediate_size"]
    n = layers * per_layer + shape["vocab_size"] * h
    return float(sum(t * (6 * n + 12 * layers * heads * d * t) for t in lengths))


def ragged_lengths(n: int, cap: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, completion) lengths of the ragged batch (see the module doc)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = int(torch.randint(max(1, cap // 64), max(2, cap // 16) + 1, (1,), generator=g))
        if i % 16 == 7:
            completion = cap - prompt  # truncated at the length cap
        else:
            completion = int(round(cap / 20 * math.exp(float(torch.randn(1, generator=g)))))
        out.append((prompt, max(1, min(completion, cap - prompt))))
    return out


def ragged_chunk(vocab: int, n: int, cap: int, seed: int = 0):
    """The ragged batch as a `TrainChunk` (random tokens, advantages and generation logprobs)."""
    import torch

    from rl_core.packing import make_train_chunk
    from rl_core.types import Sample

    g = torch.Generator().manual_seed(seed + 1)
    samples, advantages = [], []
    for prompt, completion in ragged_lengths(n, cap, seed):
        samples.append(Sample(torch.randint(0, vocab, (prompt,), generator=g).tolist(),
                              torch.randint(0, vocab, (completion,), generator=g).tolist(), [-2.0] * completion,
                              0.0, "stop", 0, 0))
        advantages.append(float(torch.randn(1, generator=g)))
    return make_train_chunk(samples, advantages)


def ragged_mode(variant: str) -> str | None:
    """The ragged mode of a variant name (`...+ragged+MODE`), None for a full-batch variant."""
    return variant.split("+ragged+", 1)[1] if "+ragged+" in variant else None


def ragged_overrides(mode: str, cap: int, max_tokens: int) -> list[str]:
    """Recipe overrides of a ragged mode: `padded` by sample count, the others by the token budget."""
    if mode == "padded":
        return [f"trainer.microbatch_size={max(1, max_tokens // cap)}", "trainer.packing=off"]
    return ["trainer.microbatch_size=4096", f"trainer.max_tokens_per_microbatch={max_tokens}",
            f"trainer.packing={'off' if mode == 'sorted' else 'on'}"]


def force_sdpa_attention() -> None:
    """`packed-sdpa`: every packed attention call through the `padded` SDPA path."""
    from rl_core.train import varlen

    varlen.attention_path = lambda q: "padded"


def processed_tokens(chunk, microbatch: int, max_tokens: int, packed: bool) -> int:
    """Tokens the model runs over in one pass of the chunk (padding included when not packed)."""
    from rl_core.train.update import chunk_rows

    lengths = chunk.attention_mask.sum(dim=1).tolist()
    total = 0
    for rows in chunk_rows(chunk, microbatch, max_tokens, packed):
        mb = [lengths[i] for i in rows]
        total += sum(mb) if packed else len(mb) * max(mb)
    return total


def ragged_summary(chunk, cfg, shape: dict, step_s: float) -> dict:
    """A ragged variant's numbers: length percentiles, useful and processed tokens, rates."""
    lengths = sorted(chunk.attention_mask.sum(dim=1).tolist())
    useful = sum(lengths)
    flops = model_flops(shape, lengths)
    t = cfg.trainer
    return {"lengths_p50": statistics.median(lengths), "lengths_p99": lengths[min(len(lengths) - 1,
                                                                                 math.ceil(0.99 * len(lengths)) - 1)],
            "lengths_max": lengths[-1], "useful_tokens": useful,
            "processed_tokens": processed_tokens(chunk, t.microbatch_size, t.max_tokens_per_microbatch,
                                                 t.packing == "on"),
            "useful_tokens_per_s": useful / step_s, "useful_tflops": flops / step_s / 1e12, "step_tflop": flops / 1e12}


def full_summary(batch: int, seq: int, tflops: float, step_s: float) -> dict:
    """A full-batch variant in the ragged table's terms: every token is useful."""
    return {"useful_tokens": batch * seq, "processed_tokens": batch * seq, "useful_tokens_per_s": batch * seq / step_s,
            "useful_tflops": tflops}


def _tflops(x: float) -> str:
    return f"{x:>9.1f}" if x >= 1 else f"{x:>9.2g}"  # a CPU row's rates are far below 1


def print_ragged_table(results: dict[str, dict], peak: float, batch: int, seq: int) -> None:
    """One table: each backend's full batch and its ragged variants, in useful tokens/s and
    TFLOP/s of useful work, against the backend's padded ragged variant and its full batch."""
    first = next((r for r in results.values() if "lengths_p50" in r), None)
    if first:
        print(f"\nragged long-tail batch: {first['useful_tokens']:,} useful tokens; lengths p50 {first['lengths_p50']:.0f}"
              f", p99 {first['lengths_p99']}, max {first['lengths_max']}; full batch {batch} x {seq}")
    print(f"{'variant':<46}{'step s':>8}{'processed':>11}{'useful':>9}{'useful tok/s':>14}{'TFLOP/s':>9}"
          f"{'of peak':>9}{'vs padded':>11}{'vs full':>9}  note")
    for name, r in results.items():
        if "useful_tflops" not in r:
            note = r.get("skipped") or "FAILED: " + (r.get("failed", "").strip().splitlines() or [""])[-1][:90]
            print(f"{name:<46}{'-':>8}{'-':>11}{'-':>9}{'-':>14}{'-':>9}{'-':>9}{'-':>11}{'-':>9}  {note}")
            continue
        base = name.split("+ragged+")[0].replace("+packed", "").replace("+mb2x", "")
        padded = results.get(f"{base}+ragged+padded", {}).get("useful_tokens_per_s")
        full = results.get(f"{base}+mb2x", {}).get("useful_tflops")
        vs_padded = f"{r['useful_tokens_per_s'] / padded:.2f}x" if padded and "+ragged+" in name else "-"
        vs_full = f"{r['useful_tflops'] / full:.0%}" if full else "-"
        print(f"{name:<46}{r['step_s']:>8.3f}{r['processed_tokens']:>11,}{r['useful_tokens']:>9,}"
              f"{r['useful_tokens_per_s']:>14,.0f}{_tflops(r['useful_tflops'])}{r['useful_tflops'] / peak:>9.1%}"
              f"{vs_padded:>11}{vs_full:>9}  loss {r['loss']:.4f}")
