"""Asynchronous vs synchronous RL on the same recipe, measured side by side in one run.

Prints, for the same number of RL steps on a long-tail completion-length distribution:
  (1) wall time of synchronous (lookahead 0) and asynchronous (lookahead 1) runs and their
      ratio, and the asynchronous step time over max(generation time, training time) per
      step measured in the synchronous run (1.0 = generation and training fully overlap);
  (2) generation-slot utilisation (mean running samples / cap) with generation-level
      backpressure (async_rl.max_inflight_generations) vs group-level only.

The long tail: a random-init tiny Qwen2 with a 256-token context whose per-request
max_tokens is drawn from a Pareto distribution (a few samples are 10-20x longer than
the median), rewards from a hash of the completion so advantages are non-zero and the
trainer does real work. Everything else is the real loop (native engine, torch trainer).

Run: .venv/bin/python bench/async_overlap.py [--steps 30]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl_core.config import validate_dict  # noqa: E402
from rl_core.controller.controller import Controller  # noqa: E402
from rl_core.controller.events import Timeline  # noqa: E402
from rl_core.types import EnvResult  # noqa: E402


class LongTailBackend:
    """The real engine; each request's max_tokens is drawn from a Pareto tail (keyed by id)."""

    def __init__(self, inner, median: int = 8, cap: int = 160):
        self.inner, self.median, self.cap = inner, median, cap
        self.samples: list[tuple[float, int]] = []  # (time, running) for utilisation

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request):
        rng = random.Random(request.request_id)
        n = min(self.cap, max(2, int(self.median * rng.paretovariate(1.3))))
        params = replace(request.params, max_tokens=n, stop_token_ids=())
        return await self.inner.generate(replace(request, params=params))


class HashEnv:
    name = "hash"
    max_turns = 1

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def prompt_ids(self, example):
        return [int(c) + 1 for c in example["prompt"]][:6]

    def stop_strings(self):
        return ()

    def score(self, example, completion_ids, completion_text, finish_reason):
        r = float(int(hashlib.sha1(bytes(completion_ids[:3])).hexdigest(), 16) % 2)
        return EnvResult(reward=r, rewards={"r": r}, info={"correct": bool(r)})


def build(tmp: Path, lookahead: int, steps: int, gen_cap: int | None, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rl_core.controller.controller import Parts
    from rl_core.data.dataset import PromptSource
    from rl_core.generation.backend import NativeBackend
    from rl_core.generation.engine import NativeEngine
    from rl_core.algorithms.losses import make_loss
    from rl_core.samplers import make_sampler
    from rl_core.train.torch_trainer import TorchTrainer

    model_dir = tmp / "model"
    if not model_dir.exists():
        torch.manual_seed(0)
        cfg_m = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                            intermediate_size=512, vocab_size=64, max_position_embeddings=256, eos_token_id=0,
                            tie_word_embeddings=False)
        Qwen2ForCausalLM(cfg_m).save_pretrained(model_dir)
    cfg = validate_dict({
        "model": {"source": "hf", "path": str(model_dir)},
        "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 8, "max_num_steps": steps, "seed": seed},
        "async_rl": {"sampler": {"type": "in_order", "max_lookahead_versions": lookahead},
                     "max_inflight_groups": 32 if gen_cap else 4, "max_buffered_groups": 32,
                     "max_inflight_generations": gen_cap, "min_groups_for_streaming_train": 2},
        "generation": {"max_tokens": 160, "max_batch_size": 64},
        "trainer": {"microbatch_size": 64},
        "validation": {"val_at_start": False, "val_at_end": False},
        "logging": {"tensorboard": False, "jsonl": False, "progress": "off"},
        "checkpoint": {"save_every_steps": 0},
    })
    examples = [{"id": i, "prompt": f"{i:06d}", "answer": ""} for i in range(4096)]
    engine = NativeEngine.from_pretrained(model_dir, max_batch_size=64, max_seq_len=256, seed=seed)
    backend = LongTailBackend(NativeBackend(engine))
    parts = Parts(tokenizer=_Tok(), env=HashEnv(None), source=PromptSource(examples, 8, seed=seed), backend=backend,
                  trainer=TorchTrainer(model_dir, cfg.trainer), loss=make_loss(cfg.loss), sampler=make_sampler(cfg),
                  val_examples=[], stop_token_ids=(), pad_id=0)
    return cfg, parts


class _Tok:
    eos_token_id = 0
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return ""


async def _run_with_utilisation(ctl: Controller, backend, cap: int):
    util: list[float] = []

    async def probe():
        while True:
            await asyncio.sleep(0.02)
            util.append(backend.inner.metrics().get("running", 0.0) / cap)

    task = asyncio.create_task(probe())
    try:
        summary = await ctl.run()
    finally:
        task.cancel()
    return summary, (statistics.fmean(util) if util else 0.0)


def run(tmp: Path, name: str, lookahead: int, steps: int, gen_cap: int | None):
    cfg, parts = build(tmp, lookahead, steps, gen_cap)
    ctl = Controller(cfg, parts, tmp / name, total_steps=steps)
    t0 = time.monotonic()
    summary, util = asyncio.run(_run_with_utilisation(ctl, parts.backend, gen_cap or 4 * 8))
    wall = time.monotonic() - t0
    spans = Timeline.read(tmp / name / "timeline.jsonl")
    gen_per_step = {}
    for s in spans:
        if s.kind == "generate":
            lo, hi = gen_per_step.get(s.step, (s.start, s.end))
            gen_per_step[s.step] = (min(lo, s.start), max(hi, s.end))
    gen = statistics.fmean(hi - lo for lo, hi in gen_per_step.values())
    train = statistics.fmean(s.end - s.start for s in spans if s.kind == "train")
    return {"name": name, "wall_s": wall, "step_s": summary["pumps_s"] / steps, "gen_s_per_step": gen,
            "train_s_per_step": train, "slot_utilisation": util, "overlap_s": summary["generation_train_overlap_s"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        sync = run(tmp, "sync", 0, args.steps, None)
        asyn = group_bp = run(tmp, "async", 1, args.steps, None)
        gen_bp = run(tmp, "async_gen_bp", 1, args.steps, 32)
    ideal = max(sync["gen_s_per_step"], sync["train_s_per_step"])
    print(json.dumps([sync, asyn, gen_bp], indent=1))
    print(f"\n(1) {args.steps} RL steps on a long-tail length distribution")
    print(f"    synchronous wall {sync['wall_s']:.1f}s, asynchronous wall {asyn['wall_s']:.1f}s: "
          f"speed-up {sync['wall_s'] / asyn['wall_s']:.2f}x")
    print(f"    per step: generation {sync['gen_s_per_step']:.3f}s, training {sync['train_s_per_step']:.3f}s "
          f"(measured synchronously); asynchronous step {asyn['step_s']:.3f}s -> "
          f"{asyn['step_s'] / ideal:.2f} x max(gen, train) (1.0 = perfect overlap)")
    print(f"(2) generation-slot utilisation: group-level backpressure (4 groups x 8 samples) "
          f"{group_bp['slot_utilisation']:.2f}, generation-level (32 samples) {gen_bp['slot_utilisation']:.2f} "
          f"-> {gen_bp['slot_utilisation'] / max(group_bp['slot_utilisation'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
