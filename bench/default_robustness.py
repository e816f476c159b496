"""The default recipe over seeds: does every initial policy the warm-up produces get there?

Run: `.venv/bin/python bench/default_robustness.py` (seeds 0-4 of `recipes/tiny-addition.yaml`,
one after the other: ~3-5 minutes each on 2 quiet cores). `--seeds 0 1 2`, `--recipe`, and
trailing dotted overrides (`-- trainer.lr=2e-4`) choose what runs. Each seed is one
`rl-core train` of the recipe with `grpo.seed` set, which seeds the tiny model's
initialisation, the warm-up's batch order and the RL run together, so each seed starts RL
from a different initial policy. The recipe's own settings otherwise: nothing is changed.

One row a seed: the warm-up's steps and its last check, the held-out accuracy before RL and
after the last RL step (the run's own validations, greedy, on the recipe's held-out set),
the points gained, the RL seconds (the run's `wall_s`) and the whole command's seconds; then
the minimum final accuracy and the range. `--json PATH` writes the rows. Timings are never
test assertions; the accuracies are what `make run` prints (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_seed(recipe: str, seed: int, out: Path, overrides: list[str]) -> dict:
    """`rl-core train RECIPE grpo.seed=SEED` into `out`; the row of its results."""
    cmd = [sys.executable, "-m", "rl_core.launch.cli", "train", recipe, f"output_dir={out}", f"run_name=seed{seed}",
           f"grpo.seed={seed}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: rl-core train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    run = out / f"seed{seed}"
    summary = json.loads((run / "summary.json").read_text())
    warm = json.loads((run / "init_policy" / "init_report.json").read_text()).get("warmup", {})
    vals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == "val"]
    return {"seed": seed, "warmup_steps": warm.get("steps"), "warmup_accuracy": warm.get("accuracy"),
            "initial": vals[0]["val/accuracy"], "final": vals[-1]["val/accuracy"], "rl_steps": summary["rl_steps"],
            "rl_s": summary["wall_s"], "command_s": seconds,
            "curve": [(r["step"], r["val/accuracy"]) for r in vals]}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/tiny-addition.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every seed (after --)")
    args = ap.parse_args(argv)
    rows = []
    print(f"{args.recipe} {' '.join(args.overrides)}".rstrip(), flush=True)
    print(f"{'seed':>4} {'warm-up':>12} {'initial':>8} {'final':>6} {'points':>7} {'RL s':>6} {'all s':>6}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rl_core_robustness_") as tmp:
        for seed in args.seeds:
            r = run_seed(args.recipe, seed, Path(tmp), args.overrides)
            rows.append(r)
            warm = f"{r['warmup_steps']} @ {r['warmup_accuracy']:.3f}" if r["warmup_steps"] is not None else "-"
            print(f"{seed:>4} {warm:>12} {r['initial']:>8.3f} {r['final']:>6.3f} "
                  f"{(r['final'] - r['initial']) * 100:>+7.1f} {r['rl_s']:>6.0f} {r['command_s']:>6.0f}", flush=True)
    finals = [r["final"] for r in rows]
    print(f"min final {min(finals):.3f} (seed {rows[finals.index(min(finals))]['seed']}); final range "
          f"{min(finals):.3f}-{max(finals):.3f}; initial range {min(r['initial'] for r in rows):.3f}-"
          f"{max(r['initial'] for r in rows):.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
