"""The default recipe's RL training step on the CPU: padded vs packed (`trainer.packing`).

Run: `python bench/train_step_cpu.py` (a minute or two on 2 quiet cores; `--json PATH`).

The recipe (`--recipe`, default recipes/tiny-addition.yaml, the embedded default): its tiny
policy built as `rl-core` builds it (warm-up off: random weights time the same), its
tokenizer and training prompts. One RL step: num_prompts_per_step x num_generations_per_prompt
samples, the recipe's prompts with completions of 1..generation.max_tokens random tokens
(seeded), streamed as the train pump streams them (chunks of min_groups_for_streaming_train
groups: `begin`, `train_microbatches` per chunk, `finish`), the recipe's loss and trainer
settings. `--tail` adds one sample in 16 at the longest length the model takes (a long-tail
step). Variants alternate step by step (padded, packed, padded, ...) so that load from
other processes falls on both alike; the median of each, and their ratio, are printed.
Does not own: GPU timings (bench/train_step_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def step_chunks(cfg, tokenizer, tail: bool, seed: int = 0) -> list:
    """One RL step's chunks, as the train pump streams them (see the module doc)."""
    import torch

    from rl_core.data.dataset import load_jsonl
    from rl_core.envs import make_env
    from rl_core.packing import make_train_chunk
    from rl_core.types import Sample

    env = make_env(cfg.env, tokenizer)
    examples = load_jsonl(ROOT / cfg.data.train_file)
    g = torch.Generator().manual_seed(seed)
    groups, k = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt
    longest = cfg.model.tiny.max_position_embeddings
    samples, advantages = [], []
    for i in range(groups):
        prompt = env.prompt_ids(examples[i % len(examples)])
        for j in range(k):
            n = int(torch.randint(1, cfg.generation.max_tokens + 1, (1,), generator=g))
            if tail and (i * k + j) % 16 == 7:
                n = longest - len(prompt)
            samples.append(Sample(prompt, torch.randint(0, len(tokenizer), (n,), generator=g).tolist(), [-1.0] * n,
                                  float(j % 2), "stop", 0, 0))
            advantages.append(float(torch.randn(1, generator=g)))
    per = cfg.async_rl.min_groups_for_streaming_train * k
    return [make_train_chunk(samples[a:a + per], advantages[a:a + per], pad_id=tokenizer.pad_token_id)
            for a in range(0, len(samples), per)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "tiny-addition.yaml"))
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each variant (after 2 warm-up steps)")
    ap.add_argument("--tail", action="store_true", help="one sample in 16 at the model's longest length")
    ap.add_argument("--json", default=None, help="where to write the results (default $OUT/train_step_cpu.json)")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from rl_core.algorithms.losses import make_loss
    from rl_core.config import read_recipe
    from rl_core.model.init_policy import init_policy
    from rl_core.train import close_trainer, make_trainer

    hf_logging.disable_progress_bar()
    cfg = read_recipe(args.recipe, ["model.warmup.enabled=false", "runtime.device=cpu"])
    if cfg.runtime.torch_num_threads:
        torch.set_num_threads(cfg.runtime.torch_num_threads)
    variants = {"padded": "off", "packed": "on"}
    with tempfile.TemporaryDirectory(prefix="rl_core_bench_") as tmp:
        policy = Path(tmp) / "policy"
        init_policy(cfg, policy, log=None)
        tokenizer = AutoTokenizer.from_pretrained(str(policy))
        chunks = step_chunks(cfg, tokenizer, args.tail)
        trainers, losses = {}, {}
        for name, packing in variants.items():
            vcfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"packing": packing})})
            trainers[name], losses[name] = make_trainer(vcfg, policy), make_loss(vcfg.loss)
        times: dict[str, list[float]] = {name: [] for name in variants}
        metrics: dict[str, dict] = {}
        try:
            for i in range(2 + args.steps):
                for name in variants:
                    t0 = time.perf_counter()
                    trainers[name].begin(losses[name])
                    for c in chunks:
                        trainers[name].train_microbatches(c)
                    metrics[name] = trainers[name].finish()
                    if i >= 2:
                        times[name].append(time.perf_counter() - t0)
        finally:
            for t in trainers.values():
                close_trainer(t)
    lengths = sorted(int(n) for c in chunks for n in c.attention_mask.sum(dim=1).tolist())
    width = sum(c.input_ids.shape[0] * c.input_ids.shape[1] for c in chunks)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"\n{Path(args.recipe).name}: one RL step on the CPU, {len(lengths)} samples in {len(chunks)} chunks, "
          f"lengths p50 {statistics.median(lengths):.0f} max {lengths[-1]}, {sum(lengths)} real of {width} padded "
          f"tokens; {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    print(f"{'variant':<10}{'step ms':>10}{'min ms':>10}{'vs padded':>11}  loss")
    for name in variants:
        print(f"{name:<10}{med[name] * 1e3:>10.1f}{min(times[name]) * 1e3:>10.1f}{med[name] / med['padded']:>10.2f}x"
              f"  {metrics[name]['loss']:.6f}")
    out = {"recipe": args.recipe, "tail": args.tail, "lengths": lengths, "padded_tokens": width,
           "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
           "results": {name: {"step_s": med[name], "steps_s": times[name], "loss": metrics[name]["loss"]}
                       for name in variants}}
    dest = args.json or (os.path.join(os.environ["OUT"], "train_step_cpu.json") if os.environ.get("OUT") else None)
    if dest:
        Path(dest).write_text(json.dumps(out, indent=1))
        print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
