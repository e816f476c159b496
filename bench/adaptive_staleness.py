"""Adaptive staleness vs fixed bounds on the toy task, side by side in one run.

Run: `nice -n 19 .venv/bin/python bench/adaptive_staleness.py [--steps 200] [--out DIR]`.
Trains the default recipe (tiny Qwen2, 2-digit addition, CPU, native engine) from one shared
warmed-up policy, one arm after the other in this process (same machine, same data order,
same seed), for the same number of RL steps:
- `fixed0`: `in_order`, `max_lookahead_versions: 0` (synchronous);
- `fixed1`: lookahead 1 (the recipe's default);
- `fixed4`: lookahead 4;
- `adaptive`: `async_rl.sampler.adaptive` on, range [0, 4], starting at 1, with the defaults of
  the rule (metric `gen_train_kl`, low 1e-3, high 3e-3, patience 5; see
  rl_core/samplers/adaptive.py).
Each arm validates on the held-out set at the end (greedy, the recipe's validation set).
Prints per arm: held-out accuracy before/after, wall time of the run, RL steps per second, the
largest staleness trained, the mean and last staleness bound, and the number of bound changes;
then the verdict of the targets: adaptive at least as accurate as `fixed4`, and at least as
fast (wall time) as `fixed1`. The numbers are whatever the run gives (wall time on a shared
machine is noisy); they are never test assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-addition.yaml"

ARMS = {
    "fixed0": ["async_rl.sampler.max_lookahead_versions=0"],
    "fixed1": ["async_rl.sampler.max_lookahead_versions=1"],
    "fixed4": ["async_rl.sampler.max_lookahead_versions=4"],
    "adaptive": ["async_rl.sampler.max_lookahead_versions=1", "async_rl.sampler.adaptive.enabled=true",
                 "async_rl.sampler.adaptive.min_lookahead_versions=0",
                 "async_rl.sampler.adaptive.max_lookahead_versions=4"],
}


def main() -> None:
    os.chdir(ROOT)
    from rl_core.config import load_recipe
    from rl_core.launch.train import ensure_policy, setup_process, train_from_recipe
    from rl_core.metrics.logger import read_jsonl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="RL steps per arm")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (runtime.torch_num_threads)")
    ap.add_argument("--out", default="results/bench_adaptive_staleness", help="output directory of the runs")
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    args = ap.parse_args()
    out = Path(args.out)
    common = [f"output_dir={out}", f"grpo.max_num_steps={args.steps}", "logging.tensorboard=false",
              "logging.progress='off'", "validation.val_period=0", "validation.val_at_start=true",
              "validation.val_at_end=true", f"runtime.torch_num_threads={args.threads}"]
    policy = out / "shared_init_policy"
    cfg0 = load_recipe(RECIPE, common + ["run_name=shared"])
    setup_process(cfg0)
    ensure_policy(cfg0, policy)
    rows = []
    for arm in args.arms:
        cfg = load_recipe(RECIPE, common + [f"run_name={arm}", *ARMS[arm]])
        run_dir = out / arm
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.copytree(policy, run_dir / "init_policy")
        t0 = time.monotonic()
        summary = train_from_recipe(cfg)
        wall = time.monotonic() - t0
        steps = read_jsonl(run_dir / "metrics.jsonl", kind="train")
        bounds = [r["async/staleness_bound"] for r in steps]
        over = sum(1 for r in steps if r["staleness/max"] > r["async/trained_staleness_bound"])
        rows.append({
            "arm": arm, "val_before": summary["val_start"]["accuracy"], "val_after": summary["val_end"]["accuracy"],
            "wall_s": wall, "pumps_s": summary["pumps_s"], "steps_per_s": args.steps / summary["pumps_s"],
            "staleness_max": summary["max_staleness"],
            "staleness_mean": sum(r["staleness/mean"] for r in steps) / len(steps),
            "bound_mean": sum(bounds) / len(bounds), "bound_last": bounds[-1],
            "bound_changes": sum(1 for a, b in zip(bounds, bounds[1:]) if a != b),
            "steps_over_trained_bound": over,
            "gen_train_kl_mean": sum(r.get("train/gen_train_kl", 0.0) for r in steps) / len(steps),
            "bounds": bounds,
        })
    (out / "adaptive_staleness.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\nadaptive staleness, {args.steps} RL steps per arm, {args.threads} torch thread(s) "
          "(held-out greedy accuracy; wall = the whole run incl. validations):")
    print(f"{'arm':<9} {'val before':>10} {'val after':>10} {'wall s':>7} {'pumps s':>8} {'steps/s':>7} "
          f"{'max stale':>9} {'mean stale':>10} {'bound mean':>10} {'bound last':>10} {'changes':>7} {'KL mean':>9}")
    for r in rows:
        print(f"{r['arm']:<9} {r['val_before']:>10.3f} {r['val_after']:>10.3f} {r['wall_s']:>7.1f} {r['pumps_s']:>8.1f} "
              f"{r['steps_per_s']:>7.2f} {r['staleness_max']:>9d} {r['staleness_mean']:>10.2f} {r['bound_mean']:>10.2f} "
              f"{r['bound_last']:>10.0f} {r['bound_changes']:>7d} {r['gen_train_kl_mean']:>9.2e}")
    by = {r["arm"]: r for r in rows}
    if {"adaptive", "fixed4", "fixed1"} <= by.keys():
        a, f4, f1 = by["adaptive"], by["fixed4"], by["fixed1"]
        acc_ok = a["val_after"] >= f4["val_after"]
        fast_ok = a["pumps_s"] <= f1["pumps_s"]
        print(f"target 1, adaptive at least as accurate as fixed4: {a['val_after']:.3f} vs {f4['val_after']:.3f} -> "
              f"{'MET' if acc_ok else 'NOT MET'}")
        print(f"target 2, adaptive at least as fast as fixed1 (pump seconds: the RL steps, without setup and "
              f"validation): {a['pumps_s']:.1f} vs {f1['pumps_s']:.1f} -> {'MET' if fast_ok else 'NOT MET'} "
              f"(whole-run wall: {a['wall_s']:.1f} vs {f1['wall_s']:.1f})")
    print(f"every step: trained staleness <= the bound its groups were admitted under: "
          f"{all(r['steps_over_trained_bound'] == 0 for r in rows)}")


if __name__ == "__main__":
    main()
