"""The ragged long-tail batch of `bench/train_step_gpu.py` (variants `...+ragged+padded|sorted|packed`).

An RL step's completions range from a few tokens to the length cap. The batch: `n` samples,
prompts uniform in [cap/64, cap/16], completions log-normal (median cap/20, sigma 1) cut at the
cap, and one sample in 16 truncated at the cap (seeded, so every variant trains the same
tokens). Variants, the same samples and step: `padded` (trainer.microbatch_size consecutive
samples padded to their longest: the trainers before packing), `sorted` (padded, but cut by
trainer.max_tokens_per_microbatch after sorting by length), `packed` (trainer.packing with the
same token budget). Useful work counts real tokens only: tokens x (6 N + 12 L H Q T_i) with
T_i each sample's own length (the trainers' FLOPs counter); "processed" tokens are those the
model ran, padding included. Does not own: the timing of steps or the full-batch variants
(train_step_gpu.py).
"""

from __future__ import annotations

import statistics

RAGGED_MODES = ("padded", "sorted", "packed")


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
            z = float(torch.randn(1, generator=g))
            completion = int(round(cap / 20 * 2.718281828 ** z))
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


def ragged_overrides(mode: str, microbatch: int, max_tokens: int) -> list[str]:
    """Recipe overrides of a ragged variant: `padded` by sample count, `sorted` / `packed` by tokens."""
    if mode == "padded":
        return [f"trainer.microbatch_size={microbatch}"]
    sets = ["trainer.microbatch_size=4096", f"trainer.max_tokens_per_microbatch={max_tokens}"]
    return sets + (["trainer.packing=true"] if mode == "packed" else [])


def ragged_flops(shape: dict, lengths: list[int]) -> float:
    """Model FLOPs of training the samples of these lengths, each with its own attention length."""
    h, layers, heads, kv = (shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "num_key_value_heads"))
    d = h // heads
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * shape["intermediate_size"]
    n = layers * per_layer + shape["vocab_size"] * h
    return float(sum(t * (6 * n + 12 * layers * heads * d * t) for t in lengths))


def processed_tokens(chunk, cfg) -> int:
    """Tokens the model runs over in one pass of the chunk under the recipe's trainer settings."""
    from rl_core.train.update import chunk_rows

    lengths = chunk.attention_mask.sum(dim=1).tolist()
    total = 0
    for rows in chunk_rows(chunk, cfg.trainer.microbatch_size, cfg.trainer.max_tokens_per_microbatch,
                           cfg.trainer.packing):
        mb = [lengths[i] for i in rows]
        total += sum(mb) if cfg.trainer.packing else len(mb) * max(mb)
    return total


def ragged_summary(chunk, cfg, shape: dict, step_s: float) -> dict:
    """The ragged row's numbers: length percentiles, useful and processed tokens, rates."""
    lengths = sorted(chunk.attention_mask.sum(dim=1).tolist())
    useful = sum(lengths)
    flops = ragged_flops(shape, lengths)
    return {"lengths_p50": statistics.median(lengths), "lengths_p99": lengths[min(len(lengths) - 1,
                                                                                 int(0.99 * len(lengths)))],
            "lengths_max": lengths[-1], "useful_tokens": useful, "processed_tokens": processed_tokens(chunk, cfg),
            "useful_tokens_per_s": useful / step_s, "useful_tflops": flops / step_s / 1e12, "step_tflop": flops / 1e12}


def print_ragged_table(results: dict[str, dict], peak: float) -> None:
    """The ragged variants: useful tokens/s and TFLOP/s, against the padded variant of the same
    backend and against the backend's full-batch TFLOP/s measured in the same call."""
    rows = {name: r for name, r in results.items() if "+ragged+" in name}
    if not rows:
        return
    first = next((r for r in rows.values() if "lengths_p50" in r), None)
    if first:
        print(f"\nragged long-tail batch: {first['useful_tokens']:,} useful tokens; lengths p50 {first['lengths_p50']:.0f}"
              f", p99 {first['lengths_p99']}, max {first['lengths_max']}")
    print(f"{'variant':<44}{'step s':>8}{'processed':>11}{'useful tok/s':>14}{'TFLOP/s':>9}{'of peak':>9}"
          f"{'vs padded':>11}{'vs full':>9}  note")
    for name, r in rows.items():
        if "useful_tflops" not in r:
            note = r.get("skipped") or "FAILED: " + (r.get("failed", "").strip().splitlines() or [""])[-1][:90]
            print(f"{name:<44}{'-':>8}{'-':>11}{'-':>14}{'-':>9}{'-':>9}{'-':>11}{'-':>9}  {note}")
            continue
        base = name.split("+ragged+")[0]
        padded = results.get(f"{base}+ragged+padded", {}).get("useful_tokens_per_s")
        full = next((v["tflops"] for k, v in results.items() if "+ragged+" not in k and "tflops" in v
                     and k.split("+mb2x")[0] == base), None)
        vs_padded = f"{r['useful_tokens_per_s'] / padded:.2f}x" if padded else "-"
        vs_full = f"{r['useful_tflops'] / full:.0%}" if full else "-"
        print(f"{name:<44}{r['step_s']:>8.3f}{r['processed_tokens']:>11,}{r['useful_tokens_per_s']:>14,.0f}"
              f"{r['useful_tflops']:>9.1f}{r['useful_tflops'] / peak:>9.1%}{vs_padded:>11}{vs_full:>9}"
              f"  loss {r['loss']:.4f}")
