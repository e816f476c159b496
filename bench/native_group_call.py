"""The event loop's CPU per prompt group with the native backend: `generate_group` (one
worker command per group, the results as columns) against `generate_many` (a request, a
command, a future and a result per sample), through `rollout.group.generate_group` (CPU, a
tiny random model, the test fakes' environment and tokenizer).

Measures `time.thread_time()` of the event loop's thread only (the engine's worker thread
is not counted), ten groups of 16 samples in flight at a time (as the rollout pump keeps
several), alternating the two calls round after round; the last line gives the medians. Both calls generate the same tokens
(tests/unit/test_native_group_arrays.py); this measures only what the controller's loop pays.

Run: nice -n 5 .venv/bin/python bench/native_group_call.py [--groups 150] [--rounds 4] [--tokens 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_core.generation import NativeBackend  # noqa: E402
from rl_core.rollout.group import GroupOptions, generate_group  # noqa: E402
from rl_core.types import SamplingParams  # noqa: E402
from tests.helpers.fakes import FakeEnv, FakeTokenizer  # noqa: E402
from tests.unit.test_generation_backend import make_engine, tiny_model  # noqa: E402

N = 16  # samples per group
AT_ONCE = 10  # groups in flight together


async def loop_cpu_per_group(model, calls: str, groups: int, tokens: int) -> float:
    env, tok = FakeEnv(), FakeTokenizer()
    params = SamplingParams(temperature=1.0, max_tokens=tokens)
    backend = NativeBackend(make_engine(model, max_batch_size=64), group_arrays=True)
    if calls == "many":
        backend.generate_group = None  # rollout.group falls back to generate_many
    await backend.start()
    ex = {"id": 1, "prompt": "1", "answer": "x"}
    prompt = env.prompt_ids(ex)
    try:
        for i in range(AT_ONCE):  # warm-up
            await generate_group(backend, env, tok, ex, prompt, N, params, f"w{i}", (0, 0, i), GroupOptions())
        t0 = time.thread_time()
        for k in range(groups // AT_ONCE):
            await asyncio.gather(*(generate_group(backend, env, tok, ex, prompt, N, params, f"g{k}-{i}", (1, k, i),
                                                  GroupOptions()) for i in range(AT_ONCE)))
        return (time.thread_time() - t0) / (groups // AT_ONCE * AT_ONCE)
    finally:
        await backend.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4, help="completion tokens per sample")
    args = ap.parse_args()
    model = tiny_model()
    out: dict[str, list[float]] = {"group": [], "many": []}
    for rnd in range(args.rounds):
        for calls in out:
            t = asyncio.run(loop_cpu_per_group(model, calls, args.groups, args.tokens))
            out[calls].append(t)
            print(f"round {rnd + 1}: {calls:5s} {t * 1e6:6.0f} us event-loop CPU per group of {N}", flush=True)
    g, m = statistics.median(out["group"]), statistics.median(out["many"])
    print(f"native backend, event-loop CPU per group of {N} (median of {args.rounds} rounds): generate_group "
          f"{g * 1e6:.0f} us, generate_many {m * 1e6:.0f} us ({m / g:.2f}x)")

if __name__ == "__main__":
    main()
