"""The controller's own cost at the group counts of real runs (CPU, no model).

Runs the real `Controller` (rollout pump, replay buffer, `in_order` sampler with
lookahead 1, generation of every group through `rollout.group.generate_group`, the
advantage stage with GRPO advantages, packing into `TrainChunk`s, streaming chunks into
the trainer through worker threads, refit, per-step metrics) with two fakes only:
generation answers at once (`InstantBackend`: a fixed-length completion, no sleep) and
training is instant (`tests/helpers/fakes.FakeTrainer`). The tokenizer's decode returns
"" and the environment is `FakeEnv` (a modulo), so tokenizer and reward costs, which
belong to the user's environment, are not counted either. What is left is the
controller's own work per RL step.

For 100, 300 and 1,000 prompt groups x 16 samples per step (10 steps each) it prints
the controller time per step (mean over the steps after the first), that time as a
fraction of a 10 s RL step, the time per group (linear scaling = a constant), and the
memory one buffered group holds (tracemalloc: ready groups committed to a `ReplayBuffer`).
The last line states the overhead at 1,000 groups as a percentage of a 10 s step.

Run: nice -n 10 .venv/bin/python bench/controller_scale.py [--groups 100 300 1000]
     [--steps 10] [--tokens 256] [--chunk 1] [--profile 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import pstats
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.fakes import FakeBackend, FakeEnv, FakeTrainer, make_parts  # noqa: E402
from rl_core.config import validate_dict  # noqa: E402
from rl_core.controller.controller import Controller  # noqa: E402
from rl_core.types import GenerationResult  # noqa: E402

STEP_S = 10.0  # the RL step the overhead is compared with
N = 16  # samples per group


class InstantBackend(FakeBackend):
    """Answers every request at once with `tokens` completion tokens (no await inside)."""

    def __init__(self, tokens: int):
        super().__init__(seed=0, max_latency_s=0.0)
        self.tokens = tokens
        self._ids = [5] * tokens
        self._lps = [-0.5] * tokens

    async def generate(self, request):
        self.calls += 1
        # one token fewer for odd request ids so rewards (FakeEnv: a modulo of the length) vary in a group
        k = self.tokens - (hash(request.request_id) & 1)
        return GenerationResult(request.request_id, request.prompt_ids, self._ids[:k], self._lps[:k], "stop",
                                self.version, self.version)


class SilentTokenizer:
    eos_token_id = 0
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return ""


def recipe(groups: int, steps: int, chunk: int, tokens: int):
    return validate_dict({
        "grpo": {"num_prompts_per_step": groups, "num_generations_per_prompt": N, "max_num_steps": steps},
        "async_rl": {"sampler": {"type": "in_order", "max_lookahead_versions": 1},
                     "max_inflight_groups": 2 * groups, "max_buffered_groups": 2 * groups,
                     "min_groups_for_streaming_train": min(chunk, groups)},
        "model": {"tiny": {"max_position_embeddings": 2 * tokens + 64}},
        "generation": {"max_tokens": tokens},
        "validation": {"val_at_start": False, "val_at_end": False},
        "logging": {"tensorboard": False, "jsonl": False, "progress": "off"},
        "checkpoint": {"save_every_steps": 0},
    })


def run_controller(groups: int, steps: int, chunk: int, tokens: int, tmp: Path, profile: bool = False):
    cfg = recipe(groups, steps, chunk, tokens)
    parts = make_parts(cfg, backend=InstantBackend(tokens), trainer=FakeTrainer(),
                       num_examples=groups * (steps + 2))
    parts.tokenizer = SilentTokenizer()
    parts.env = FakeEnv()
    ctl = Controller(cfg, parts, tmp / f"g{groups}", total_steps=steps)
    marks: list[tuple[float, float]] = []  # (wall, CPU of this process) at each step end
    orig = ctl._on_step

    async def on_step(step, metrics, trained):
        marks.append((time.monotonic(), time.process_time()))
        await orig(step, metrics, trained)


    ctl._on_step = on_step
    prof = cProfile.Profile() if profile else None
    gc.collect()
    t0 = time.monotonic()
    if prof:
        prof.enable()
    summary = asyncio.run(ctl.run())
    if prof:
        prof.disable()
    wall = time.monotonic() - t0
    assert summary["rl_steps"] == steps, summary["rl_steps"]
    # steps 1.. (step 0 also fills the lookahead and warms caches); CPU time is the primary
    # measure: on a shared machine wall time also counts other processes' time slices
    cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    wall_steps = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    return {"groups": groups, "wall_s": wall, "pumps_s": summary["pumps_s"], "per_step_cpu_s": cpu,
            "steady_s": statistics.fmean(cpu), "steady_wall_s": statistics.fmean(wall_steps)}, prof


def memory_per_group(groups: int, tokens: int) -> float:
    """Bytes one ready group holds in the buffer (samples, token lists, metadata), via tracemalloc."""
    from rl_core.buffer.replay_buffer import ReplayBuffer
    from rl_core.rollout.group import GroupOptions, generate_group, sampling_params
    from rl_core.types import PromptGroup

    cfg = recipe(groups, 1, 1, tokens)
    backend, env, tok = InstantBackend(tokens), FakeEnv(), SilentTokenizer()
    params = sampling_params(cfg.generation, (0,))

    async def fill():
        buf = ReplayBuffer(groups)
        for i in range(groups):
            gid = f"e0-p{i}-d{i}"
            buf.reserve(gid, i, i, 0, 0, 0)
            ex = {"id": i, "prompt": str(i), "answer": "x"}
            samples = await generate_group(backend, env, tok, ex, env.prompt_ids(ex), N, params, gid, (0, 0, i),
                                           GroupOptions())
            await buf.commit(gid, PromptGroup(group_id=gid, prompt_index=i, epoch=0, example=ex, samples=samples,
                                              start_version=0, end_version=0, target_step=0))
        return buf

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    buf = asyncio.run(fill())
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    total = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert len(buf.ready()) == groups
    return total / groups


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, nargs="+", default=[100, 300, 1000])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=256, help="completion tokens per sample")
    ap.add_argument("--chunk", type=int, default=1, help="async_rl.min_groups_for_streaming_train")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the run with this many groups")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="intra-op threads (the controller's tensors are small; more threads only contend)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.torch_threads)
    print(f"controller-only cost: {N} samples/group, {args.tokens} completion tokens/sample, {args.steps} steps, "
          f"in_order lookahead 1, streaming chunks of {args.chunk} group(s); generation and training instant")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for g in args.groups:
            r, prof = run_controller(g, args.steps, args.chunk, args.tokens, Path(d), profile=g == args.profile)
            r["mem_per_group"] = memory_per_group(min(g, 300), args.tokens)
            rows.append(r)
            print(f"  {g:5d} groups x {N}: controller {r['steady_s'] * 1e3:8.1f} ms CPU/step "
                  f"(wall {r['steady_wall_s'] * 1e3:.1f} ms) = {r['steady_s'] / STEP_S:.3%} of a {STEP_S:.0f} s "
                  f"step; {r['steady_s'] / g * 1e6:7.1f} us/group; buffered group {r['mem_per_group'] / 1024:.1f} KiB "
                  f"({r['mem_per_group'] / (N * args.tokens):.1f} B/completion token)", flush=True)
            if prof:
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
                print(s.getvalue())
    per_group = [r["steady_s"] / r["groups"] for r in rows]
    lo, hi = min(per_group), max(per_group)
    each = ", ".join(f"{r['groups']}: {p * 1e6:.1f} us" for r, p in zip(rows, per_group))
    print(f"linearity: time per group {each} -> max/min {hi / lo:.2f} (1.00 = linear)")
    last = rows[-1]
    print(f"controller overhead at {last['groups']} groups x {N} samples: {last['steady_s'] * 1e3:.1f} ms per step = "
          f"{100 * last['steady_s'] / STEP_S:.2f}% of a {STEP_S:.0f} s RL step")


if __name__ == "__main__":
    main()
