"""The controller's own cost at the group counts of real runs (CPU, no model).

Runs the real `Controller` (rollout pump, replay buffer, `in_order` sampler with
lookahead 1, generation of every group through `rollout.group.generate_group`, the
advantage stage with GRPO advantages, packing into `TrainChunk`s, streaming chunks into
the trainer through worker threads, refit, per-step metrics) with two fakes only:
generation answers at once (`InstantBackend`: a fixed-length completion, no sleep; by
default one `generate_group` call per group, the results as columns; `--calls many` for one
`generate_many` call per group, a request and a result per sample, the path before the
group call; `--calls per-sample` for one `generate` per sample; several `--calls` with
`--rounds R` alternate them, round after round, in one run) and training is instant (`tests/helpers/fakes.FakeTrainer`). The tokenizer's decode
returns "" and the environment is `FakeEnv` (a modulo), which by default also scores a group
generated in one group call in one `score_group` call (`TimedEnv`: the same rewards as columns,
`columns.GroupScores`); `--scoring per-sample` turns that off (a `score` call per sample, what
every built-in environment gets); several `--scoring` alternate like `--calls`. The CPU time
the fakes spend in their own bodies (building results, scoring) is taken out
(`FakeCalls`: calls counted in the run, cost per call calibrated after it); what is left
is the controller's own work per RL step, including its calls into the fakes.

`--calls http` replaces the fake backend by the real `HttpBackend` (aiohttp, one completions
request a group, packed answers: what `generation.backend: http` does with rl_core servers)
against the instant local server of `bench/http_client_cost.py` (a subprocess that answers at
once with `--tokens` tokens a choice, stopped by its PID at the end): the HTTP client's CPU is
then counted as the controller's, as it is in a real run with generation servers. The server's
own CPU is another process's and not counted. Refit only tells the server the new version.

The backend hands token ids and logprobs over as NumPy arrays (what the native backend's
group calls do, the default backend's: packing is then a memory copy) or as
fresh Python lists (what the HTTP and vLLM backends, and every backend's per-sample
`generate`, do); `--results both` (the default) runs both.

For 100, 300 and 1,000 prompt groups x 16 samples per step (10 steps each) it prints
the controller time per step (mean over the steps after the first), that time as a
fraction of a 10 s RL step, the time per group (linear scaling = a constant), and the
memory one buffered group holds (tracemalloc: ready groups committed to a `ReplayBuffer`).
The last line states the overhead at 1,000 groups as a percentage of a 10 s step.

`--env addition` runs the built-in addition environment instead of `FakeEnv`, closer to a
real run: `AdditionBackend` answers each group of the task's prompts (the real environment's
`prompt_ids`, the tiny tokenizer) with completions the environment scores (right answers,
wrong ones, long texts ending on the end token or cut by length: ragged lengths), the
decoded texts are looked up by default (`PrecomputedDecode`: a decode is tokenizer work, taken out like
the fakes'), and the environment's own work (encoding each group's prompt, scoring) is
counted as the controller's, as it runs on the controller's event loop in a real run; its
scoring's share is printed beside each row. `--scoring per-sample` turns the environment's
group scoring off. `--env fake addition` alternates both.

`--decode` (--env addition) chooses how the completions' texts are decoded: `looked-up` (the
default, the seventh round's measure: the text looked up, the decode taken out), `loop` (the
real tokenizer's `decode` per completion on the event loop, counted: what a real run paid
before the eighth round) or `thread` (the real tokenizer, through `rollout.decode.decode_group`:
one Rust `decode_batch` per group on a decode thread, counted: what a real run pays now);
several alternate like `--env`. Each row also prints the event loop thread's own CPU time per
step (`time.thread_time` on the loop, the fakes' work taken out), beside the process's (every
thread: the decode threads' work is in the process time, not in the loop's).
The bench sets TOKENIZERS_PARALLELISM=false unless it is set, as `rl-core train` does
(`launch.train.setup_process`): `decode_batch` then decodes a group's texts in turn on the
decode thread, not over the Rust thread pool (on 2 cores that pool's threads cost the loop
thread more than they save).

With several `--calls`, `--scoring`, `--env` or `--rounds`, the last line gives each
combination's mean over the rounds.

Run: nice -n 10 .venv/bin/python bench/controller_scale.py [--groups 100 300 1000]
     [--steps 10] [--tokens 256] [--chunk 1] [--results lists|arrays|both]
     [--calls group many per-sample http] [--scoring group per-sample] [--env fake addition]
     [--decode looked-up loop thread] [--rounds 1]
     [--per-sample-calls]
     [--profile 1000]

The fake parts (backends, environments, the fakes' cost accounting) live in
`bench/controller_scale_fakes.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # what `rl-core train` sets (launch/train.py)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.helpers.fakes import FakeEnv, FakeTrainer, make_parts  # noqa: E402
from rl_core.config import validate_dict  # noqa: E402
from rl_core.controller.controller import Controller  # noqa: E402
from http_client_cost import start_server  # noqa: E402
from rl_core.generation.http.backend import HttpBackend  # noqa: E402
from controller_scale_fakes import (CALLS, N, AdditionBackend, InstantBackend, SilentTokenizer,  # noqa: E402
                                    TimedEnv, addition_parts, env_scoring_cost)

STEP_S = 10.0  # the RL step the overhead is compared with


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


HTTP_URL: list = [None, 0]  # --calls http: the instant server's URL and completion tokens


class InstantServerBackend(HttpBackend):
    """`--calls http`: the real HttpBackend (aiohttp, a completions request per group, packed
    answers) against `http_client_cost.py`'s instant server. Refit tells the server the new
    version only (its answers carry it, as a real server's do); a real refit's file writes or
    broadcast are the weight sync's cost, not timed here (the fake backends skip them too)."""

    def __init__(self, urls):
        super().__init__(urls, model_name="m", health_check_interval_s=600.0)

    async def start(self) -> None:
        import httpx

        for url in (ep.url for ep in self.endpoints):  # each run starts from version 0, as the trainer
            httpx.post(f"{url}/rl/update_weights", json={"version": 0, "path": "-"}).raise_for_status()
        await super().start()

    async def update_weights(self, version, weights) -> None:
        for ep in self.endpoints:
            await self.fleet.request("POST", ep, "/rl/update_weights", json={"version": version, "path": "-"})
            ep.version = version
        self._version = version


def run_controller(groups: int, steps: int, chunk: int, tokens: int, tmp: Path, profile: bool = False,
                   arrays: bool = False, calls: str = "group", scoring: str = "group", env: str = "fake",
                   decode: str = "looked-up"):
    cfg = recipe(groups, steps, chunk, tokens)
    if env == "addition":
        parts = addition_parts(cfg, tokens, arrays, scoring, groups * (steps + 2), decode)
        backend = parts.backend
    else:
        backend = InstantServerBackend([HTTP_URL[0]]) if calls == "http" else InstantBackend(tokens, arrays, calls)
        parts = make_parts(cfg, backend=backend, trainer=FakeTrainer(), num_examples=groups * (steps + 2))
        parts.tokenizer = SilentTokenizer()
        parts.env = TimedEnv(group_scoring=scoring == "group")
    ctl = Controller(cfg, parts, tmp / f"g{groups}", total_steps=steps)
    marks: list[tuple[float, float, tuple, float]] = []  # (wall, process CPU, fakes' work counts, loop thread CPU)
    orig = ctl._on_step

    async def on_step(step, metrics, trained):
        marks.append((time.monotonic(), time.process_time(), CALLS.counts(), time.thread_time()))
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
    # measure: on a shared machine wall time also counts other processes' time slices. The
    # fakes' own time (generation, environment) is taken out: it is not the controller's.
    env_s = 0.0
    if env == "addition":
        CALLS.calibrate_addition(backend, backend.looked_up)
        env_s = env_scoring_cost(parts.env, backend, backend.looked_up, scoring) * groups
    else:  # HttpBackend's work is all the controller's: only the environment's is taken out
        CALLS.calibrate(backend if isinstance(backend, InstantBackend) else InstantBackend(tokens, True), parts.env)
    cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    fakes = [CALLS.spent_between(a[2], b[2]) for a, b in zip(marks, marks[1:])]
    wall_steps = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    loop = [b[3] - a[3] for a, b in zip(marks, marks[1:])]  # the fakes run on the loop thread
    return {"groups": groups, "wall_s": wall, "pumps_s": summary["pumps_s"], "per_step_cpu_s": cpu,
            "fakes_s": statistics.fmean(fakes), "steady_s": statistics.fmean(c - f for c, f in zip(cpu, fakes)),
            "loop_s": statistics.fmean(c - f for c, f in zip(loop, fakes)), "env_s": env_s, "completion_tokens": statistics.fmean(map(len, backend_sample_ids(backend))),
            "steady_wall_s": statistics.fmean(wall_steps)}, prof


def backend_sample_ids(backend) -> list:
    """One group's completions (for the mean completion length reported)."""
    if isinstance(backend, AdditionBackend):
        return backend.answer_group(next(iter(backend.answers)), list(range(N))).token_ids
    if not isinstance(backend, InstantBackend):  # the instant server's choices
        return [range(HTTP_URL[1])] * N
    return [range(backend.tokens - (i & 1)) for i in range(N)]


def memory_per_group(groups: int, tokens: int, arrays: bool) -> float:
    """Bytes one ready group holds in the buffer (samples, token lists or arrays, metadata), via tracemalloc."""
    from rl_core.buffer.replay_buffer import ReplayBuffer
    from rl_core.rollout.group import GroupOptions, generate_group, sampling_params
    from rl_core.types import PromptGroup

    cfg = recipe(groups, 1, 1, tokens)
    backend, env, tok = InstantBackend(tokens, arrays, fresh=True), FakeEnv(), SilentTokenizer()
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


CALL_NAMES = {"group": "a generate_group call per group (columns)",
              "many": "a generate_many call per group (a request and a result per sample)",
              "per-sample": "a generate call per sample",
              "http": "the real HttpBackend, a completions request per group to an instant local server (packed "
                      "answers; the HTTP client's CPU counted)"}


SCORING_NAMES = {"group": "a score_group call per group (columns)", "per-sample": "a score call per sample"}


ENV_NAMES = {"fake": "FakeEnv (a modulo; its own work taken out)",
             "addition": "the addition environment (real scoring, included)"}


DECODE_NAMES = {"looked-up": "the completions' texts looked up (the decode taken out)",
                "loop": "the real decode per completion on the event loop (counted)",
                "thread": "the real decode, one decode_batch per group on a decode thread (counted)"}


def run_rows(args, mode: str, calls: str, scoring: str, d: str, env: str = "fake",
             decode: str = "looked-up") -> list[dict]:
    """One pass over `args.groups` with one result form, one kind of call, one kind of
    scoring and one environment, printed as it goes."""
    print(f"backend hands token ids and logprobs as {'NumPy arrays' if mode == 'arrays' else 'Python lists'}, "
          f"{CALL_NAMES[calls]}; {ENV_NAMES[env]}, {SCORING_NAMES[scoring]}"
          + (f", {DECODE_NAMES[decode]}" if env != "fake" else "") + ":")
    rows = []
    for g in args.groups:
        r, prof = run_controller(g, args.steps, args.chunk, args.tokens,
                                 Path(d) / mode / calls / scoring / env / decode, profile=g == args.profile,
                                 arrays=mode == "arrays", calls=calls, scoring=scoring, env=env, decode=decode)
        r["mem_per_group"] = memory_per_group(min(g, 300), args.tokens, mode == "arrays")
        rows.append(r)
        print(f"  {g:5d} groups x {N}: controller {r['steady_s'] * 1e3:8.1f} ms CPU/step "
              f"(process {sum(r['per_step_cpu_s']) / len(r['per_step_cpu_s']) * 1e3:.1f}, fakes "
              f"{r['fakes_s'] * 1e3:.1f}; wall {r['steady_wall_s'] * 1e3:.1f}; event loop thread "
              f"{r['loop_s'] * 1e3:.1f} = {r['loop_s'] / STEP_S:.3%}) = {r['steady_s'] / STEP_S:.3%} "
              f"of a {STEP_S:.0f} s step; {r['steady_s'] / g * 1e6:7.1f} us/group; buffered group "
              f"{r['mem_per_group'] / 1024:.1f} KiB ({r['mem_per_group'] / (N * args.tokens):.1f} "
              "B/completion token)" + (f"; the environment's scoring ~{r['env_s'] * 1e3:.1f} ms of it (included), "
                                       f"{r['completion_tokens']:.0f} completion tokens per sample"
                                       if env != "fake" else ""), flush=True)
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            print(s.getvalue())
    per_group = [r["steady_s"] / r["groups"] for r in rows]
    lo, hi = min(per_group), max(per_group)
    each = ", ".join(f"{r['groups']}: {p * 1e6:.1f} us" for r, p in zip(rows, per_group))
    print(f"  linearity: time per group {each} -> max/min {hi / lo:.2f} (1.00 = linear)")
    if len(rows) >= 2:  # least-squares line: a fixed cost per step + a cost per group
        gs = [r["groups"] for r in rows]
        ts = [r["steady_s"] for r in rows]
        gm, tm = statistics.fmean(gs), statistics.fmean(ts)
        slope = sum((g - gm) * (t - tm) for g, t in zip(gs, ts)) / sum((g - gm) ** 2 for g in gs)
        icpt = tm - slope * gm
        dev = max(abs(t - (icpt + slope * g)) / t for g, t in zip(gs, ts))
        print(f"  line fit: {icpt * 1e3:.1f} ms per step + {slope * 1e6:.1f} us per group "
              f"(largest deviation {dev:.1%} of a point)")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, nargs="+", default=[100, 300, 1000])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=256, help="completion tokens per sample")
    ap.add_argument("--chunk", type=int, default=1, help="async_rl.min_groups_for_streaming_train")
    ap.add_argument("--results", choices=["lists", "arrays", "both"], default="both",
                    help="how the fake backend hands over token ids and logprobs: Python lists, NumPy arrays, or "
                         "both (two runs)")
    ap.add_argument("--calls", choices=list(CALL_NAMES), nargs="+", default=["group"],
                    help="how the fake backend is called: generate_group per group (the results as columns), "
                         "generate_many per group (a request and a result per sample), or generate per sample; "
                         "or http: the real HttpBackend against an instant local server (arrays only); "
                         "several alternate within each round")
    ap.add_argument("--scoring", choices=list(SCORING_NAMES), nargs="+", default=["group"],
                    help="how the fake environment scores a group generated in one group call: one score_group call "
                         "(the scores as columns) or a score call per sample (what environments without score_columns "
                         "get); several alternate within each round")
    ap.add_argument("--env", choices=list(ENV_NAMES), nargs="+", default=["fake"],
                    help="the environment: FakeEnv (a modulo of the length, its cost taken out) or the built-in "
                         "addition environment (its real scoring counted, completions it can score from "
                         "AdditionBackend; group calls only); several alternate within each round")
    ap.add_argument("--decode", choices=list(DECODE_NAMES), nargs="+", default=["looked-up"],
                    help="--env addition: the completions' texts looked up (decode taken out), decoded by the real "
                         "tokenizer on the event loop (counted, the path before the eighth round), or in one "
                         "decode_batch per group on a decode thread (counted, the path now); several alternate")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every (results, calls, scoring) pass this many times, "
                    "alternating (timings on a shared machine drift; alternation spreads the drift over all)")
    ap.add_argument("--per-sample-calls", action="store_true", help="the same as --calls per-sample")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the run with this many groups")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="intra-op threads (the controller's tensors are small; more threads only contend)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.torch_threads)
    calls_list = ["per-sample"] if args.per_sample_calls else list(dict.fromkeys(args.calls))
    scoring_list = list(dict.fromkeys(args.scoring))
    env_list = list(dict.fromkeys(args.env))
    if calls_list == ["http"] and args.results == "lists":
        ap.error("--calls http runs with --results arrays (HttpBackend's packed answers come as arrays); "
                 "--results lists has no rows to run for it")
    if "addition" in env_list and (calls_list != ["group"] or args.tokens < 16):
        ap.error("--env addition needs --calls group and --tokens of at least 16")
    print(f"controller-only cost: {N} samples/group, {args.tokens} completion tokens/sample, {args.steps} steps, "
          f"in_order lookahead 1, streaming chunks of {args.chunk} group(s); generation and training instant; "
          f"{' / '.join(CALL_NAMES[c] for c in calls_list)}; "
          f"{' / '.join(SCORING_NAMES[c] for c in scoring_list)}; {' / '.join(ENV_NAMES[e] for e in env_list)}; "
          f"{args.rounds} round(s); "
          "CPU time of the fakes' own work (calibrated per call) taken out")
    server = None
    if "http" in calls_list:
        server, HTTP_URL[0] = start_server(args.tokens)
        HTTP_URL[1] = args.tokens
    try:
        run_all(args, calls_list, scoring_list, env_list)
    finally:
        if server is not None:
            server.terminate()  # by its PID
            server.wait(timeout=10)


def run_all(args, calls_list: list, scoring_list: list, env_list: list) -> None:
    modes = ["arrays", "lists"] if args.results == "both" else [args.results]
    decode_list = list(dict.fromkeys(args.decode))
    # (mode, calls, scoring, env, decode) -> the largest count's row per round
    last: dict[tuple[str, str, str, str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as d:
        for rnd in range(args.rounds):
            if args.rounds > 1:
                print(f"round {rnd + 1} of {args.rounds}:")
            for mode in modes:
                for calls in calls_list:
                    if calls == "http" and mode == "lists":
                        continue  # HttpBackend's packed answers come as arrays
                    for env in env_list:
                        for scoring in scoring_list:
                            for decode in (decode_list if env != "fake" else ["looked-up"]):
                                rows = run_rows(args, mode, calls, scoring, d, env, decode)
                                last.setdefault((mode, calls, scoring, env, decode), []).append(rows[-1])
    parts = []
    for (mode, calls, scoring, env, decode), rows in last.items():
        ms = [r["steady_s"] * 1e3 for r in rows]
        mean, loop = statistics.fmean(ms), statistics.fmean(r["loop_s"] * 1e3 for r in rows)
        each = "" if len(ms) == 1 else f" (rounds: {' / '.join(f'{m:.1f}' for m in ms)})"
        texts = f", texts {decode}" if env != "fake" else ""
        parts.append(f"{mean:.1f} ms per step = {mean / (10 * STEP_S):.2f}% of a {STEP_S:.0f} s RL step "
                     f"(event loop thread {loop:.1f} ms = {loop / (10 * STEP_S):.2f}%) with {mode} "
                     f"from the backend, {calls} calls, {env} environment, {scoring} scoring{texts}{each}")
    groups = rows[-1]["groups"]
    print(f"controller overhead at {groups} groups x {N} samples: " + "; ".join(parts))


if __name__ == "__main__":
    main()
