"""Adaptive staleness vs fixed bounds on the toy task, side by side in one run.

Owns: the bench only (arms, their order, the table and the verdicts); the rule is
rl_core/samplers/adaptive.py, the runs are `rl-core train`'s (`train_from_recipe`).

Run: `nice -n 5 .venv/bin/python bench/adaptive_staleness.py [--steps 300] [--repeats 4] [--out DIR]`.
Trains the default recipe (tiny Qwen2, 2-digit addition, CPU, native engine) from one shared
warmed-up policy, in this process, for the same number of RL steps per arm:
- `fixed0`: `in_order`, `max_lookahead_versions: 0` (synchronous);
- `fixed1`: lookahead 1 (the recipe's default);
- `fixed4`: lookahead 4;
- `adaptive`: `async_rl.sampler.adaptive` on, range [1, 4] (the rule's default range), starting
  at 1, the rule's default thresholds (metric `gen_train_kl`, low 1e-3, high 3e-3, patience 5);
- `adaptive_min0` (not run unless named in `--arms`): the same with range [0, 4], the range of
  the first runs (docs/controller.md, runs A-C).
Noise control: the arms run interleaved, in rounds whose orders form a balanced Latin
square (Williams design; 4 arms: A B D C, B C A D, C D B A, D A C B): over as many rounds as
arms every arm runs once in every position and follows every other arm once, so a drift of
the machine's load hits every arm alike; round r
uses seed `grpo.seed + r` for every arm (arms are paired within a round, rounds independent);
one torch thread per arm (`--threads`). Each arm validates on the held-out set at the start
and the end (greedy, the recipe's validation set).

Prints one row per arm and round, then one row per arm with the mean and the sample standard
deviation over the rounds of the held-out accuracy and of the pump seconds (the RL steps
without setup and validation) and of the process CPU seconds of the whole arm (all threads:
the work done, which the load of other jobs does not change as it changes wall time), then a verdict line per clause of the target, judged on the
means: adaptive at least as accurate as `fixed4`, and at least as fast as `fixed1`. Each
verdict also gives the difference of the means with its standard error (from the spread
over rounds) and the rounds in which the paired comparison held, so a verdict inside the
noise reads as such. The machine's load average (`os.getloadavg`) is printed at the start
and the end. The numbers are whatever the run gives; they are never test assertions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-addition.yaml"

_ADAPTIVE = ["async_rl.sampler.max_lookahead_versions=1", "async_rl.sampler.adaptive.enabled=true",
             "async_rl.sampler.adaptive.max_lookahead_versions=4"]
ARMS = {
    "fixed0": ["async_rl.sampler.max_lookahead_versions=0"],
    "fixed1": ["async_rl.sampler.max_lookahead_versions=1"],
    "fixed4": ["async_rl.sampler.max_lookahead_versions=4"],
    "adaptive": [*_ADAPTIVE, "async_rl.sampler.adaptive.min_lookahead_versions=1"],
    "adaptive_min0": [*_ADAPTIVE, "async_rl.sampler.adaptive.min_lookahead_versions=0"],
}
DEFAULT_ARMS = ["fixed0", "fixed1", "fixed4", "adaptive"]


def round_orders(arms: list[str], rounds: int) -> list[list[str]]:
    """Williams design: row i = (first row + i) mod n, first row 0, 1, n-1, 2, n-2, ..."""
    n = len(arms)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    return [[arms[(j + i) % n] for j in first] for i in range(rounds)]


def _load() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def _cpu_s() -> float:
    """CPU seconds of this process so far (every thread, user + system)."""
    t = os.times()
    return t.user + t.system


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else float("nan"))


def _kl_by_trained_staleness(steps: list[dict]) -> dict[int, float]:
    """Median `train/gen_train_kl` of the steps grouped by their largest trained staleness."""
    by: dict[int, list[float]] = {}
    for r in steps:
        by.setdefault(int(r["staleness/max"]), []).append(float(r.get("train/gen_train_kl", 0.0)))
    return {k: statistics.median(v) for k, v in sorted(by.items())}


def run_arm(arm: str, rnd: int, seed: int, common: list[str], out: Path, policy: Path, steps_n: int) -> dict:
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import train_from_recipe
    from rl_core.metrics.logger import read_jsonl

    name = f"{arm}_r{rnd}"
    cfg = load_recipe(RECIPE, common + [f"run_name={name}", f"grpo.seed={seed}", *ARMS[arm]])
    run_dir = out / name
    if run_dir.exists():  # replaced only when it is a run this bench wrote (its copied init_policy is there)
        if not (run_dir / "init_policy").is_dir():
            raise SystemExit(f"{run_dir} exists and is not a run of this bench; move it away or choose another --out")
        shutil.rmtree(run_dir)
    shutil.copytree(policy, run_dir / "init_policy")
    load_before = os.getloadavg()[0]
    t0, c0 = time.monotonic(), _cpu_s()
    summary = train_from_recipe(cfg)
    wall, cpu = time.monotonic() - t0, _cpu_s() - c0
    steps = read_jsonl(run_dir / "metrics.jsonl", kind="train")
    bounds = [r["async/staleness_bound"] for r in steps]
    return {
        "arm": arm, "round": rnd, "seed": seed, "load_before": load_before, "load_after": os.getloadavg()[0],
        "val_before": summary["val_start"]["accuracy"], "val_after": summary["val_end"]["accuracy"],
        "wall_s": wall, "cpu_s": cpu, "pumps_s": summary["pumps_s"], "steps_per_s": steps_n / summary["pumps_s"],
        "staleness_max": summary["max_staleness"],
        "staleness_mean": statistics.fmean(r["staleness/mean"] for r in steps),
        "bound_mean": statistics.fmean(bounds), "bound_last": bounds[-1],
        "bound_changes": sum(1 for a, b in zip(bounds, bounds[1:]) if a != b),
        "steps_at_bound": {str(b): bounds.count(b) for b in sorted(set(bounds))},
        "steps_over_trained_bound": sum(1 for r in steps if r["staleness/max"] > r["async/trained_staleness_bound"]),
        "gen_train_kl_mean": statistics.fmean(r.get("train/gen_train_kl", 0.0) for r in steps),
        "kl_median_by_staleness": _kl_by_trained_staleness(steps),
        "bounds": bounds,
    }


def main() -> None:
    os.chdir(ROOT)
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import ensure_policy, setup_process

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="RL steps per arm")
    ap.add_argument("--repeats", type=int, default=4, help="rounds; each runs every arm once (orders: a balanced Latin square)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (runtime.torch_num_threads)")
    ap.add_argument("--out", default="results/bench_adaptive_staleness", help="output directory of the runs")
    ap.add_argument("--arms", nargs="*", default=DEFAULT_ARMS, choices=list(ARMS))
    args = ap.parse_args()
    out = Path(args.out)
    common = [f"output_dir={out}", f"grpo.max_num_steps={args.steps}", "logging.tensorboard=false",
              "logging.progress='off'", "validation.val_period=0", "validation.val_at_start=true",
              "validation.val_at_end=true", f"runtime.torch_num_threads={args.threads}"]
    cfg0 = load_recipe(RECIPE, common + ["run_name=shared"])
    setup_process(cfg0)
    policy = ensure_policy(cfg0, out / "shared_init_policy")
    n_val = sum(1 for line in Path(cfg0.data.val_file).read_text().splitlines() if line.strip())
    if cfg0.validation.max_val_samples:
        n_val = min(n_val, cfg0.validation.max_val_samples)
    load_start = _load()
    print(f"start: {load_start}", flush=True)
    rows = []
    for rnd, order in enumerate(round_orders(args.arms, args.repeats)):
        for arm in order:
            rows.append(run_arm(arm, rnd, cfg0.grpo.seed + rnd, common, out, policy, args.steps))
            r = rows[-1]
            print(f"[round {rnd} {arm}] val {r['val_after']:.3f} pumps {r['pumps_s']:.1f} s "
                  f"bound mean {r['bound_mean']:.2f} ({_load()})", flush=True)
    load_end = _load()
    (out / "adaptive_staleness.json").write_text(json.dumps(
        {"steps": args.steps, "repeats": args.repeats, "threads": args.threads, "n_val": n_val,
         "load_start": load_start, "load_end": load_end, "rows": rows}, indent=2) + "\n")

    print(f"\nadaptive staleness, {args.steps} RL steps per arm, {args.repeats} round(s) (Latin-square orders), "
          f"{args.threads} torch thread(s); held-out greedy accuracy on {n_val} prompts; pumps s = the RL steps "
          "without setup and validation")
    print(f"{'arm':<13} {'round':>5} {'val after':>9} {'pumps s':>8} {'cpu s':>6} {'steps/s':>7} {'max stale':>9} "
          f"{'mean stale':>10} {'bound mean':>10} {'changes':>7} {'KL mean':>9}  KL median by trained staleness")
    for r in rows:
        kl = " ".join(f"{k}:{v:.1e}" for k, v in r["kl_median_by_staleness"].items())
        print(f"{r['arm']:<13} {r['round']:>5d} {r['val_after']:>9.3f} {r['pumps_s']:>8.1f} {r['cpu_s']:>6.1f} {r['steps_per_s']:>7.2f} "
              f"{r['staleness_max']:>9d} {r['staleness_mean']:>10.2f} {r['bound_mean']:>10.2f} "
              f"{r['bound_changes']:>7d} {r['gen_train_kl_mean']:>9.2e}  {kl}")
    arms = [a for a in ARMS if a in args.arms]
    acc = {a: [r["val_after"] for r in rows if r["arm"] == a] for a in arms}
    pumps = {a: [r["pumps_s"] for r in rows if r["arm"] == a] for a in arms}
    print(f"\nper arm over {args.repeats} round(s): mean +- sample sd (one validation's binomial standard "
          f"error at p = 0.2 on {n_val} prompts: {math.sqrt(0.2 * 0.8 / n_val):.3f})")
    print(f"{'arm':<13} {'val after':>15} {'pumps s':>13} {'cpu s':>13} {'bound mean':>10} {'steps at bound 0':>16}")
    for a in arms:
        am, asd = _mean_sd(acc[a])
        pm, psd = _mean_sd(pumps[a])
        ar = [r for r in rows if r["arm"] == a]
        cm, csd = _mean_sd([r["cpu_s"] for r in ar])
        print(f"{a:<13} {am:>7.3f} +- {asd:.3f} {pm:>6.1f} +- {psd:>4.1f} {cm:>6.1f} +- {csd:>4.1f} "
              f"{statistics.fmean(r['bound_mean'] for r in ar):>10.2f} "
              f"{statistics.fmean(r['steps_at_bound'].get('0', 0) for r in ar):>16.1f}")

    def verdict(label: str, a: str, b: str, data: dict, better: str, unit: str) -> None:
        """`better`: "ge" = a's mean at least b's (accuracy), "le" = at most (seconds)."""
        if a not in data or b not in data:
            return
        ma, mb = statistics.fmean(data[a]), statistics.fmean(data[b])
        d = ma - mb
        n = len(data[a])
        # paired by round: the standard error of the mean per-round difference
        diffs = [x - y for x, y in zip(data[a], data[b])]
        se = statistics.stdev(diffs) / math.sqrt(n) if n > 1 else float("nan")
        ok = ma >= mb if better == "ge" else ma <= mb
        held = sum(1 for x in diffs if (x >= 0 if better == "ge" else x <= 0))
        noise = "" if math.isnan(se) else (" (inside the noise: |difference| < 2 standard errors)" if abs(d) < 2 * se
                                           else " (beyond 2 standard errors)")
        print(f"{label}: {a} {ma:.3f} vs {b} {mb:.3f} {unit} (mean of {n}); difference {d:+.3f} +- {se:.3f}{noise}; "
              f"held in {held} of {n} rounds -> {'MET' if ok else 'NOT MET'}")

    verdict("clause 1, adaptive at least as accurate as fixed4", "adaptive", "fixed4", acc, "ge", "held-out accuracy")
    verdict("clause 2, adaptive at least as fast as fixed1", "adaptive", "fixed1", pumps, "le", "pump s")
    if "adaptive_min0" in arms:
        verdict("for comparison, adaptive_min0 at least as accurate as fixed4", "adaptive_min0", "fixed4", acc, "ge",
                "held-out accuracy")
        verdict("for comparison, adaptive_min0 at least as fast as fixed1", "adaptive_min0", "fixed1", pumps, "le", "pump s")
    print(f"every step of every arm: trained staleness <= the bound its groups were admitted under: "
          f"{all(r['steps_over_trained_bound'] == 0 for r in rows)}")
    print(f"start: {load_start}; end: {load_end}")


if __name__ == "__main__":
    main()
