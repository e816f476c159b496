"""The controller's CPU a sample with real vLLM generating, a request a sample against a request a group (CPU).

Runs in the vLLM tier's venv (`ci/vllm_tier.sh --setup` builds it). Both vLLM backends generate
the same prompt groups on the default recipe's tiny model, side by side in one run:

- `VLLMBackend` (in process, `placement: colocated`): `AsyncLLM` in the controller's process,
  its EngineCore (the model) in a child process;
- `VLLMServerBackend` (`placement: separate`): a real vLLM OpenAI server in a child process,
  driven over HTTP;

each with a `generate` call per sample (`--calls per-sample`) and with the group call
(`generate_group`: one request of `n` with consecutive seeds). The CPU time of this process
alone is counted (`time.process_time`): the EngineCore and the server are other processes.
That is the controller's share: request handling, vLLM's output processing in the
controller's process (in-process backend), the HTTP client and JSON (server backend). It
prints the CPU a sample and what 1,000 groups x 16 samples would take as a share of a 10 s
step. The timed part runs with the collector settings of the controller's pumps. The server is
stopped by its PID at the end (the backend's shutdown), the engine by its shutdown.

Run: ~/.cache/rl_core/vllm-venv/bin/python bench/vllm_client_cost.py [--groups 48] [--tokens 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N = 16  # samples a group
STEP_SAMPLES, STEP_S = 16_000, 10.0


def tiny_policy(out: Path) -> Path:
    """The default recipe's tiny model, random init (no warm-up): what the vLLM tier tests use."""
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import ensure_policy, setup_process

    os.chdir(ROOT)
    cfg = load_recipe(ROOT / "recipes" / "tiny-addition.yaml", ["model.warmup.enabled=false"])
    setup_process(cfg)
    return ensure_policy(cfg, out / "init_policy")


async def cost(backend, groups: int, tokens: int, calls: str, tag: str) -> float:
    """Controller CPU seconds a sample over `groups` groups (8 at once), after a warm-up group."""
    from rl_core.metrics.gc_pauses import freeze_setup_objects, run_thresholds, unfreeze
    from rl_core.types import SamplingParams, group_requests

    params = SamplingParams(temperature=1.0, max_tokens=tokens)
    gate = asyncio.Semaphore(8)

    async def one(g: int):
        seeds = [(g << 8) + i for i in range(N)]
        prompt = [5 + g % 50, 6, 7, 8, 9, 10]
        async with gate:
            if calls == "group":
                await backend.generate_group(f"{tag}-g{g}", prompt, params, seeds)
            else:
                await asyncio.gather(*(backend.generate(r)
                                       for r in group_requests(f"{tag}-g{g}", prompt, params, seeds)))

    await one(10_000)
    freeze_setup_objects()
    old = run_thresholds(64)
    try:
        cpu = time.process_time()
        await asyncio.gather(*(one(g) for g in range(groups)))
        return (time.process_time() - cpu) / (groups * N)
    finally:
        gc.set_threshold(*old)
        unfreeze()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=48, help="groups of 16 timed per backend and kind of call")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens a sample")
    ap.add_argument("--rounds", type=int, default=2, help="alternate the kinds of call this many times")
    args = ap.parse_args()
    from rl_core.generation.vllm.backend import VLLMBackend, VLLMOptions
    from rl_core.generation.vllm.server import VLLMServerBackend

    with tempfile.TemporaryDirectory() as tmp:
        policy = tiny_policy(Path(tmp))
        options = VLLMOptions(model=str(policy), max_model_len=64, max_num_seqs=128)
        results: dict[tuple[str, str], list[float]] = {}
        loop = asyncio.new_event_loop()
        for name, backend in (("VLLMBackend (in process)", VLLMBackend(options)),
                              ("VLLMServerBackend (HTTP)", VLLMServerBackend(options, weights_dir=Path(tmp) / "w"))):
            loop.run_until_complete(backend.start())
            try:
                for rnd in range(args.rounds):
                    for calls in ("per-sample", "group"):
                        per = loop.run_until_complete(cost(backend, args.groups, args.tokens, calls, f"{rnd}{calls}"))
                        results.setdefault((name, calls), []).append(per)
                        print(f"  {name}, {calls} calls, round {rnd + 1}: {per * 1e6:7.1f} us a sample", flush=True)
            finally:
                loop.run_until_complete(backend.shutdown())
        loop.close()
    print(f"controller CPU a sample ({args.tokens} new tokens, mean of {args.rounds} rounds; 16,000 samples a 10 s step):")
    for (name, calls), values in results.items():
        per = sum(values) / len(values)
        print(f"  {name:<26} {calls:<10} {per * 1e6:7.1f} us = {per * STEP_SAMPLES / STEP_S * 100:5.1f}% of the step")


if __name__ == "__main__":
    main()
