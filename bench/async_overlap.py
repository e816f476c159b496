"""Asynchronous vs synchronous RL on a long-tail workload, side by side in one run.

The workload: every RL step trains 16 prompt groups x 8 samples. A sample's completion
length is drawn from a Pareto tail (alpha 1.3) keyed by (prompt, sample index), so every
configuration sees the same lengths: median 24 tokens, about 3% of the samples 10-20x
the median (capped at 20x). A synchronous step must wait for its slowest sample.

The engine is simulated so that only scheduling is measured, deterministically and fast
on a shared CPU: `SlotEngine` is a continuous-batching engine with 32 sequence slots
(a quarter of a step's samples) and a fixed decode time per token for the whole batch
(the memory-bound regime of a real GPU engine: a decode step costs about the same at 4 or
32 sequences); requests beyond 32 queue. Training is a fake whose time is fixed per
sample (streamed chunks) plus an optimizer step. Everything else is the real controller:
rollout pump, valves, samplers, buffer, advantage stage, refit, metrics.

Configurations, all for the same number of RL steps:
  sync                 in_order, lookahead 0, group-level cap (4 groups = 32 samples in flight)
  sync+gen_bp          in_order, lookahead 0, generation-level backpressure (the whole step
                       submitted, 32 samples generating at once: what a plain synchronous loop does)
  async                in_order, lookahead 1, group-level cap (4 groups)
  async+gen_bp         + generation-level backpressure: async_rl.max_inflight_generations 32
                       (a slot is held by a sample, not by its group), group cap 2 steps
  async+gen_bp Lk       the same with lookahead k = 2, 4 (a larger staleness bound: more steps
                       of groups may exist, so the engine has work while step s waits for
                       its straggler); group cap and buffer (k + 1) steps
  async+gen_bp+partial Lk Bb
                       partial rollouts (async_rl.sampler.partial_rollouts): lookahead k; when
                       the step needs a group and none of its own is ready, a straggler swaps
                       steps with a ready group of a later step and keeps generating (across
                       refits), never trained with staleness above b; nothing is aborted
  async+gen_bp+oversample
                       windowed sampler (staleness <= 1), async_rl.over_sampling_ratio 1.25:
                       a step trains the first groups ready; stragglers train in the next
                       step inside the window or are aborted/evicted (counted as wasted)

Prints per configuration: wall time, time per step, speed-up over sync, generation-slot
utilisation (time-weighted mean of running sequences / slots while the pumps run), wasted
samples (the controller's count, and every sample generated but never trained), the largest trained staleness with the arm's bound (checked), the mean trained
staleness and the carried groups, and the run's phases: the fill (until every slot is
first busy), the final drain (from the last time a request took a slot: the last stragglers
finish with nothing left to start, then the last step trains) and the steady-state
utilisation between them; then the targets' verdicts, judged on the whole-run utilisation.

The drain is a fixed cost per run (about one straggler's length plus one optimizer step,
~0.9 s here), so whole-run utilisation grows with --steps: at the default, 16 steps, it is
14-15% of the run of the arms that meet the target without waste; at 8 steps 22-23%, which
keeps them at 0.76-0.79 whole-run with the same steady state (docs/controller.md has both).
A real run of hundreds of steps pays it once.

Run: nice -n 5 .venv/bin/python bench/async_overlap.py [--steps 16] [--tick-ms 2] [--only ARM ...]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.fakes import FakeBackend, FakeTrainer, make_parts  # noqa: E402
from rl_core.config import validate_dict  # noqa: E402
from rl_core.controller.controller import Controller  # noqa: E402
from rl_core.types import GenerationResult  # noqa: E402

GROUPS, N, SLOTS = 16, 8, 32
MEDIAN, TAIL_CAP, ALPHA = 24, 20, 1.3
_ID = re.compile(r"-p(\d+)-.*/(\d+)$")


def completion_length(request_id: str) -> int:
    """Pareto-tailed length with the given median, keyed by (prompt index, sample index)."""
    m = _ID.search(request_id)
    rng = random.Random(f"{m.group(1)}/{m.group(2)}" if m else request_id)
    x_min = MEDIAN / 2 ** (1 / ALPHA)  # the median of Pareto(x_min, alpha) is x_min * 2^(1/alpha)
    return max(1, min(TAIL_CAP * MEDIAN, round(x_min * rng.paretovariate(ALPHA))))


class SlotEngine(FakeBackend):
    """A continuous-batching engine with `slots` sequence slots; every decode tick of
    `tick_s` advances each running sequence by one token; extra requests queue (FIFO)."""

    def __init__(self, slots: int, tick_s: float):
        super().__init__(seed=0, max_latency_s=0.0)
        self.slots, self.tick_s = slots, tick_s
        self.waiting: list[list] = []  # [request, tokens left, future]
        self.running: list[list] = []
        self.busy = 0.0  # integral of running slots over time
        # measurement only: decode ticks credited (sum over loop turns of the ticks done; the
        # nominal rate is one tick per tick_s of wall time) and tokens decoded (each sequence's
        # own tokens, so a long loop turn does not count past a sequence's end)
        self.ticks = 0
        self.tokens = 0
        self.t_first = self.t_last = None
        # phases (measurement only): the busy integral after each loop turn, the first time every
        # slot was busy (the pipeline is filled) and the last time a request took a slot (from then
        # on nothing new starts: the run's final drain)
        self.trace: list[tuple[float, float, int, float]] = []  # (turn start, turn end, running, busy after)
        self.t_full = None
        self.t_last_start = None
        self._credit = 0.0  # decode ticks owed to the running sequences (fraction of a tick)
        self._wake = asyncio.Event()
        self._loop_task = None

    async def start(self):
        self._loop_task = asyncio.create_task(self._loop())

    async def shutdown(self):
        if self._loop_task is not None:
            self._loop_task.cancel()

    def metrics(self):
        return {"running": float(len(self.running))}

    def capacity(self):
        return self.slots

    async def generate(self, request):
        self.calls += 1
        v0 = self.version
        entry = [request, completion_length(request.request_id), asyncio.get_running_loop().create_future()]
        self.waiting.append(entry)
        self._wake.set()
        try:
            n = await entry[2]
        finally:  # an aborted (cancelled) request frees its slot
            for q in (self.waiting, self.running):
                if entry in q:
                    q.remove(entry)
        return GenerationResult(request.request_id, request.prompt_ids, [5] * n, [-0.5] * n, "stop", v0, self.version)

    def busy_at(self, t: float) -> float:
        """The busy integral (slot-seconds) up to time `t` (constant while the engine is idle)."""
        i = bisect.bisect_left(self.trace, t, key=lambda r: r[1])
        if i >= len(self.trace):
            return self.busy
        t0, t1, running, after = self.trace[i]
        return after - running * (t1 - max(t0, t)) if t > t0 else after - running * (t1 - t0)

    async def _loop(self):
        last = time.monotonic()
        while True:
            while self.waiting and len(self.running) < self.slots:
                e = self.waiting.pop(0)
                e.append(e[1])  # total length, returned when done
                self.running.append(e)
                self.t_last_start = time.monotonic()
            if self.t_full is None and len(self.running) >= self.slots:
                self.t_full = time.monotonic()
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                last = time.monotonic()
                self._credit = 0.0  # idle time is owed to nobody
                continue
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            dt = now - last
            last = now
            self.busy += len(self.running) * dt
            self.trace.append((now - dt, now, len(self.running), self.busy))
            self.t_first = self.t_first if self.t_first is not None else now - dt
            self.t_last = now
            # decode ticks done in dt: the fraction of a tick left over carries to the next turn, so
            # the engine decodes at its nominal rate (one tick per tick_s of wall time) however long
            # a loop turn takes on a loaded host (rounding each turn lost up to half a tick)
            self._credit += dt / self.tick_s
            steps = int(self._credit)
            self._credit -= steps
            if steps == 0:
                continue
            self.ticks += steps
            for e in list(self.running):
                self.tokens += min(steps, e[1])
                e[1] -= steps
                if e[1] <= 0:
                    self.running.remove(e)
                    if not e[2].done():
                        e[2].set_result(e[3])


class TimedTrainer(FakeTrainer):
    """Training that takes `per_sample_s` per streamed sample plus `finish_s` per optimizer step."""

    def __init__(self, per_sample_s: float, finish_s: float):
        super().__init__()
        self.per_sample_s, self.finish_s = per_sample_s, finish_s

    def train_microbatches(self, chunk):
        time.sleep(self.per_sample_s * chunk.num_samples)
        super().train_microbatches(chunk)

    def finish(self, advance_version=True):
        time.sleep(self.finish_s)
        return super().finish(advance_version)


def configs(oversample: float) -> dict:
    group_cap = SLOTS // N  # group-level: as many groups as fill the engine's slots
    return {
        "sync": {"sampler": {"type": "in_order", "max_lookahead_versions": 0},
                 "max_inflight_groups": group_cap, "max_buffered_groups": 2 * GROUPS},
        "sync+gen_bp": {"sampler": {"type": "in_order", "max_lookahead_versions": 0},
                        "max_inflight_groups": 2 * GROUPS, "max_inflight_generations": SLOTS,
                        "max_buffered_groups": 2 * GROUPS},
        "async": {"sampler": {"type": "in_order", "max_lookahead_versions": 1},
                  "max_inflight_groups": group_cap, "max_buffered_groups": 2 * GROUPS},
        "async+gen_bp": {"sampler": {"type": "in_order", "max_lookahead_versions": 1},
                         "max_inflight_groups": 2 * GROUPS, "max_inflight_generations": SLOTS,
                         "max_buffered_groups": 2 * GROUPS},
        # larger staleness bounds with generation-level backpressure: more steps of groups may
        # exist, so the engine keeps generating while step s waits for its straggler
        **{f"async+gen_bp L{la}": {"sampler": {"type": "in_order", "max_lookahead_versions": la},
                                   "max_inflight_groups": (la + 1) * GROUPS, "max_inflight_generations": SLOTS,
                                   "max_buffered_groups": (la + 1) * GROUPS} for la in (2, 4)},
        # partial rollouts: lookahead L, a straggler is carried to a later step (staleness <= B)
        **{f"async+gen_bp+partial L{la} B{b}": {
            "sampler": {"type": "in_order", "max_lookahead_versions": la,
                        "partial_rollouts": {"enabled": True, "max_staleness_versions": b}},
            "max_inflight_groups": (la + 1) * GROUPS, "max_inflight_generations": SLOTS,
            "max_buffered_groups": (la + 1) * GROUPS} for la, b in ((1, 2), (1, 4), (2, 4))},
        "async+gen_bp+oversample": {"sampler": {"type": "windowed", "max_staleness_versions": 1},
                                    "over_sampling_ratio": oversample, "max_inflight_groups": 4 * GROUPS,
                                    "max_inflight_generations": SLOTS, "max_buffered_groups": 4 * GROUPS},
    }


def run_one(name: str, steps: int, tick_s: float, train_s: float, tmp: Path, oversample: float) -> dict:
    cfg = validate_dict({
        "grpo": {"num_prompts_per_step": GROUPS, "num_generations_per_prompt": N, "max_num_steps": steps},
        "async_rl": {**configs(oversample)[name], "min_groups_for_streaming_train": 1},
        "model": {"tiny": {"max_position_embeddings": TAIL_CAP * MEDIAN + 64}},
        "generation": {"max_tokens": TAIL_CAP * MEDIAN},
        "validation": {"val_at_start": False, "val_at_end": False},
        "logging": {"tensorboard": False, "jsonl": False, "progress": "off"},
        "checkpoint": {"save_every_steps": 0},
    })
    engine = SlotEngine(SLOTS, tick_s)
    trainer = TimedTrainer(per_sample_s=0.6 * train_s / (GROUPS * N), finish_s=0.4 * train_s)
    parts = make_parts(cfg, backend=engine, trainer=trainer, num_examples=GROUPS * (4 * steps + 8))
    ctl = Controller(cfg, parts, tmp / name, total_steps=steps)
    t0 = time.monotonic()
    summary = asyncio.run(ctl.run())
    wall = time.monotonic() - t0
    span = (engine.t_last - engine.t_first) if engine.t_first is not None else 0.0
    util_pumps = engine.busy / (SLOTS * summary["pumps_s"]) if summary["pumps_s"] > 0 else 0.0
    phases = run_phases(engine, ctl, summary["pumps_s"])
    return {"name": name, "wall_s": wall, "pumps_s": summary["pumps_s"], "step_s": summary["pumps_s"] / steps,
            "slot_utilisation": util_pumps, "slot_utilisation_while_decoding": engine.busy / (SLOTS * span) if span else 0,
            # the engine's decode rate in wall time against its nominal one tick per tick_s (the
            # event loop's timer overshoot under load, rounded per turn, slows it), and the tokens
            # decoded against the nominal capacity (slots tokens per tick) over the pumps' time:
            # slot utilisation counts a slot busy until its loop turn ends, so long turns on a
            # loaded machine inflate it; this one does not
            "engine_rate": engine.ticks * tick_s / span if span else 0.0,
            "nominal_rate_utilisation": engine.tokens * tick_s / (SLOTS * summary["pumps_s"]) if summary["pumps_s"] else 0.0,
            "generated_samples": engine.calls, "wasted_samples": ctl.ledger.wasted_samples,
            # generated (or started) but never trained: the wasted ones plus groups still ready in the
            # buffer when the run ended (the controller does not count those as wasted)
            "untrained_samples": engine.calls - N * len(ctl.train.staleness_log),
            "max_staleness": summary["max_staleness"], "staleness_bound": staleness_bound(cfg),
            "mean_staleness": sum(ctl.train.staleness_log) / max(1, len(ctl.train.staleness_log)),
            "carried_groups": summary["carried_groups"], **phases}


def run_phases(engine: SlotEngine, ctl: Controller, pumps_s: float) -> dict:
    """Split the pumps' time into the fill (until every slot is first busy), the steady state and
    the final drain (from the last time a request took a slot: nothing new starts after it, the
    last stragglers finish, then the last step trains and refits), with slot utilisation in each."""
    t0 = ctl._t_pumps
    end = t0 + pumps_s
    refits = ctl.timeline.of("refit")
    last_step_end = ctl.timeline.t0 + max(s.end for s in refits) if refits else end
    fill_end = min(engine.t_full, end) if engine.t_full is not None else t0
    drain_start = max(fill_end, min(engine.t_last_start, end)) if engine.t_last_start is not None else end
    gen_end = min(engine.t_last, end) if engine.t_last is not None else drain_start

    def util(a: float, b: float) -> float:
        return (engine.busy_at(b) - engine.busy_at(a)) / (SLOTS * (b - a)) if b > a else 0.0

    return {"fill_s": fill_end - t0, "steady_s": drain_start - fill_end, "drain_s": end - drain_start,
            "drain_generating_s": max(0.0, gen_end - drain_start), "drain_after_generation_s": end - max(gen_end, drain_start),
            "fill_utilisation": util(t0, fill_end), "steady_utilisation": util(fill_end, drain_start),
            "drain_utilisation": util(drain_start, end), "after_last_step_s": max(0.0, end - last_step_end)}


def staleness_bound(cfg) -> int:
    """The largest staleness the arm's recipe allows a trained group."""
    s = cfg.async_rl.sampler
    if s.type == "in_order":
        return s.partial_rollouts.max_staleness_versions if s.partial_rollouts.enabled else s.max_lookahead_versions
    return s.max_staleness_versions


def main():
    global GROUPS, SLOTS
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16, help="RL steps per arm (the final drain is a fixed cost per run)")
    ap.add_argument("--tick-ms", type=float, default=2.0, help="decode time per token (whole batch)")
    ap.add_argument("--train-s", type=float, default=0.25, help="training time per RL step")
    ap.add_argument("--groups", type=int, default=GROUPS, help="prompt groups per RL step")
    ap.add_argument("--slots", type=int, default=SLOTS, help="engine sequence slots")
    ap.add_argument("--oversample", type=float, default=1.25, help="async_rl.over_sampling_ratio")
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    GROUPS, SLOTS = args.groups, args.slots
    lengths = sorted(completion_length(f"e0-p{p}-d0/a0/{i}") for p in range(GROUPS * args.steps) for i in range(N))
    med = lengths[len(lengths) // 2]
    tail = sum(1 for x in lengths if x >= 10 * med) / len(lengths)
    print(f"workload: {args.steps} steps x {GROUPS} groups x {N} samples; completion length median {med}, "
          f"max {lengths[-1]} ({lengths[-1] / med:.0f}x), {tail:.1%} of samples >= 10x median; decode "
          f"{args.tick_ms:g} ms/token for up to {SLOTS} sequences; training {args.train_s:g} s/step")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in args.only or configs(args.oversample):
            rows.append(run_one(name, args.steps, args.tick_ms / 1000, args.train_s, Path(d), args.oversample))
            r = rows[-1]
            print(f"  {name:30s} wall {r['wall_s']:6.2f}s  step {r['step_s']:.3f}s  "
                  f"speed-up {rows[0]['pumps_s'] / r['pumps_s']:.2f}x  slot utilisation {r['slot_utilisation']:.2f}  "
                  f"wasted {r['wasted_samples']:3d}/{r['generated_samples']} samples ({r['untrained_samples']} never "
                  f"trained)  staleness max "
                  f"{r['max_staleness']} (bound {r['staleness_bound']}) mean {r['mean_staleness']:.2f}  "
                  f"carried {r['carried_groups']}  engine rate {r['engine_rate']:.2f}  nominal-rate utilisation "
                  f"{r['nominal_rate_utilisation']:.2f}  steady-state utilisation {r['steady_utilisation']:.2f}  "
                  f"fill {r['fill_s']:.2f}s drain {r['drain_s']:.2f}s ({r['drain_generating_s']:.2f}s generating at "
                  f"{r['drain_utilisation']:.2f}, {r['drain_after_generation_s']:.2f}s after; pumps ran {r['after_last_step_s']:.2f}s past the last step)", flush=True)
    print(json.dumps(rows, indent=1))
    over = [r["name"] for r in rows if r["max_staleness"] > r["staleness_bound"]]
    print("staleness: every trained group within its arm's bound" if not over
          else f"STALENESS BOUND EXCEEDED in {over}")
    by = {r["name"]: r for r in rows}
    if {"sync", "sync+gen_bp", "async", "async+gen_bp"} <= by.keys():
        s, sg, a = by["sync"], by["sync+gen_bp"], by["async"]
        print(f"vs sync at equal steps (target >= 2x): async (group-level) {s['pumps_s'] / a['pumps_s']:.2f}x")
        print(f"slot utilisation over the whole run (target >= 0.8 and above group-level async "
              f"{a['slot_utilisation']:.2f}); steady state = without the fill and the final drain:")
        for r in rows:
            if r["name"].startswith("async+gen_bp"):
                ok = r["slot_utilisation"] >= 0.8 and r["slot_utilisation"] > a["slot_utilisation"]
                print(f"  {r['name']:30s} {s['pumps_s'] / r['pumps_s']:.2f}x vs sync, "
                      f"{sg['pumps_s'] / r['pumps_s']:.2f}x vs sync+gen_bp; utilisation {r['slot_utilisation']:.2f} "
                      f"{'met' if ok else 'not met'} (nominal-rate {r['nominal_rate_utilisation']:.2f}, steady state "
                      f"{r['steady_utilisation']:.2f}; drain {r['drain_s']:.2f}s = {r['drain_s'] / r['pumps_s']:.0%} of the run); "
                      f"max staleness {r['max_staleness']}, {r['wasted_samples']} samples wasted")

if __name__ == "__main__":
    main()
