"""What the workflow costs on top of training: the same short run in one process and as the
Snakemake workflow, measured side by side in one invocation.

    .venv/bin/python bench/workflow_overhead.py [--recipe recipes/tiny-addition-short.yaml] [--slurm]

Both runs start from one initial policy (built first, imported as an HF model by both), so
the warm-up is not counted. The workflow does more than `rl-core train` (it validates every
epoch, evaluates the final and best checkpoints and draws the report), so the ratio is an
upper bound of the orchestration overhead; the per-stage seconds show where it goes. Prints wall seconds of each, their ratio, and per stage of the
workflow the seconds between its log's start and done lines (train_epoch includes the
submitit job's start-up). `--slurm` adds a third run with `--profile profiles/slurm` (needs a
running cluster: `bash ci/slurm-local/up.sh`). No timing here is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def _run(cmd: list[str], cwd: Path) -> float:
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return time.monotonic() - t0


def _stage_seconds(logs: Path) -> dict[str, float]:
    out = {}
    stamp = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)"
    for log in sorted(logs.glob("*.log")):
        text = log.read_text()
        start, done = re.search(rf"^=== \S+ .* started {stamp}", text, re.M), re.findall(rf"done {stamp}$", text, re.M)
        if start and done:
            t = [datetime.strptime(s, "%Y-%m-%d %H:%M:%S") for s in (start.group(1), done[-1])]
            out[log.stem] = (t[1] - t[0]).total_seconds()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/tiny-addition-short.yaml")
    ap.add_argument("--slurm", action="store_true", help="also run with --profile profiles/slurm")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rl_core-bench-"))
    for name in ("recipes", "data", "config"):
        (work / name).symlink_to(ROOT / name)
    policy = work / "policy"
    _run([PY, "-m", "rl_core.launch.cli", "init-policy", args.recipe, "output_dir=" + str(work / "init"),
          "--out", str(policy)], work)
    hf = ["model.source=hf", f"model.path={policy}", "logging.tensorboard=false"]

    t_proc = _run([PY, "-m", "rl_core.launch.cli", "train", args.recipe, "run_name=inproc",
                   "output_dir=" + str(work / "inproc"), *hf], work)
    snake = [PY, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(work), "--config",
             f"recipe={args.recipe}", "overrides=" + json.dumps(hf)]
    t_wf = _run([*snake, "run=wf", "--cores", "2"], work)
    rows = [("in-process (rl-core train)", t_proc), ("workflow, local (snakemake --cores 2)", t_wf)]
    if args.slurm:
        rows.append(("workflow, Slurm (--profile profiles/slurm)",
                     _run([*snake, "run=wf-slurm", "--profile", str(ROOT / "profiles" / "slurm")], work)))
    print(f"recipe {args.recipe}; work dir {work}")
    for name, t in rows:
        print(f"  {name:45s} {t:7.1f} s   x{t / t_proc:5.2f} of in-process")
    stages = _stage_seconds(work / "results" / "wf" / "logs")
    train = sum(v for k, v in stages.items() if k.startswith("train_epoch"))
    print("  workflow stages (s): " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(stages.items())))
    print(f"  train_epoch share of the local workflow: {train / t_wf:.0%}")


if __name__ == "__main__":
    main()
