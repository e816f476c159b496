"""End to end on one GPU, side by side with TRL (issue 44): time to held-out accuracy.

One device call per task: the initial policy built once by the recipe's initial-policy stage
(recipes/gpu-addition.yaml or gpu-repeat.yaml), then each arm from it in its own process
(bench/e2e_arms.py) with the same data, prompts per step, group size, max tokens, temperature,
lr, loss (no KL), reward and RL steps: rl_core async (lookahead 1), rl_core sync (lookahead 0),
TRL's GRPOTrainer (transformers generation, one run per seed) and the colocated refit
(export_weights(on_device=True) in process vs a CPU round trip). Per arm: s/RL step, generated
and trained tokens/s, GPU busy (nvidia-smi utilization.gpu every 200 ms over the arm's training
window), held-out accuracy every --eval-every steps against steps and wall-clock (evaluation
excluded), peak memory. Writes $OUT/e2e_<task>.json and .png; time-boxed (--budget-s, an arm
that does not fit is skipped). `--device cpu --tiny`: the same code paths, tiny, on a CPU.
    python bench/e2e_gpu.py --task addition --steps 60 --eval-every 10 --seeds 0,1
Results and the TRL field map: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"addition": ROOT / "recipes" / "gpu-addition.yaml", "repeat": ROOT / "recipes" / "gpu-repeat.yaml"}
TINY = ["runtime.device=cpu", "model.dtype=float32", "trainer.compile=false", "runtime.torch_num_threads=1",
        "model.tiny.hidden_size=64", "model.tiny.num_hidden_layers=2", "model.tiny.num_attention_heads=4",
        "model.tiny.num_key_value_heads=2", "model.tiny.intermediate_size=128", "model.warmup.device=cpu",
        "model.warmup.lr=1.0e-3", "model.warmup.num_eval_prompts=32", "validation.max_val_samples=32",
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "trainer.lr=1.0e-3",
        "async_rl.min_groups_for_streaming_train=2", "logging.tensorboard=false", "logging.progress='off'"]
TINY_TASK = {"addition": ["model.warmup.target_accuracy=0.05", "model.warmup.eval_every_steps=10"],
             "repeat": ["model.warmup.enabled=false",
                      "generation.max_tokens=48", "validation.sampling.max_tokens=48", "validation.max_val_samples=8",
                      "data.max_train_examples=64"]}
BENCH = ["logging.tensorboard=false", "logging.progress='off'", "checkpoint.save_every_steps=0"]


class GpuSampler:
    """nvidia-smi's utilization.gpu every 200 ms into a file (absent without nvidia-smi)."""

    def __init__(self, path: Path):
        self.path, self.proc = path, None
        try:
            self.fh = open(path, "w")
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                          "-lms", "200"], stdout=subprocess.PIPE, text=True, bufsize=1)
        except (OSError, FileNotFoundError):
            self.proc = None
        self.samples: list[tuple[float, float]] = []
        if self.proc is not None:
            import threading

            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.samples.append((time.time(), float(line.strip().split(",")[0])))
            except ValueError:
                continue

    def busy(self, t0: float, t1: float) -> float | None:
        s = [u for t, u in self.samples if t0 <= t <= t1]
        return sum(s) / len(s) / 100.0 if s else None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def run_child(arm: str, args, tmp: Path, name: str, sets: list[str], policy: Path, timeout_s: float) -> dict:
    out = tmp / f"{name}.json"
    log = tmp / f"{name}.log"
    cmd = [sys.executable, str(ROOT / "bench" / "e2e_arms.py"), arm, "--recipe", str(RECIPES[args.task]),
           "--overrides", json.dumps(sets), "--policy", str(policy), "--run-dir", str(tmp / name),
           "--device", args.device, "--eval-every", str(args.eval_every), "--json", str(out)]
    t = time.time()
    if timeout_s < 20:
        return {"skipped": f"{timeout_s:.0f}s left in the time box"}
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "bench"),
                                                                                  os.environ.get("PYTHONPATH", "")])}
                                ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    res = json.loads(out.read_text()) if out.exists() else {}
    res["wall_s"] = time.time() - t
    if not out.exists():
        res["failed"] = f"exit {rc}"
        res["log"] = log.read_text()[-3000:]
        shutil.copyfile(log, Path(args.out) / log.name)  # the whole log of a failed arm, for its first error
    elif rc != 0:  # the results were written; the process was then stopped (time box) or failed on its way out
        res["exit"] = rc
    return res


def build_policy(args, tmp: Path, sets: list[str]) -> tuple[Path, dict]:
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import ensure_policy, setup_process

    cfg = load_recipe(RECIPES[args.task], sets)
    setup_process(cfg)
    t = time.time()
    policy = ensure_policy(cfg, tmp / "init_policy")
    report = json.loads((policy / "init_report.json").read_text())
    report["wall_s"] = time.time() - t
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the warm-up's memory goes back before the arms start
    return policy, report


def summarize(r: dict, busy: float | None) -> dict:
    if "failed" in r or "skipped" in r or not r.get("steps"):
        return r
    w = r["train_wall_s"]
    r.update(s_per_step=w / r["steps"], gen_tokens_per_s=r["gen_tokens"] / w, trained_tokens_per_s=r["trained_tokens"] / w,
             gpu_busy=busy, final_accuracy=r["curve"][-1]["accuracy"] if r["curve"] else None)
    return r


def time_to(curve: list[dict], acc: float) -> float | None:
    """Wall-clock (evaluation excluded) at the first held-out check after step 0 reaching `acc`."""
    return next((p["wall_s"] for p in curve if p["step"] > 0 and p["accuracy"] >= acc), None)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in res["arms"].items():
        if r.get("curve"):
            a.plot([p["step"] for p in r["curve"]], [p["accuracy"] for p in r["curve"]], marker="o", label=name)
            b.plot([max(p["wall_s"], 0.0) for p in r["curve"]], [p["accuracy"] for p in r["curve"]], marker="o",
                   label=name)
    a.set_xlabel("RL step")
    b.set_xlabel("wall-clock s (held-out evaluation excluded)")
    for ax in (a, b):
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{res['task']}: {res.get('policy', {}).get('num_parameters', '?')} parameters, {res['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=sorted(RECIPES), default="addition")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny model and batch (a check of the code paths)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per arm (default: the recipe's)")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seeds", default="0,1", help="TRL seeds (rl_core async runs seed 0 and, time allowing, 1)")
    ap.add_argument("--arms", default="refit,async,sync,trl",
                    help="comma-separated subset of refit, async, sync, trl, async1, eager, run in this order")
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("RL_CORE_BENCH_BUDGET_S", "540")))
    ap.add_argument("--arm-cap-s", type=json.loads, default={"rlcore": 150, "trl": 100, "refit": 60},
                    help="seconds each kind of arm may take at most (JSON)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--set", action="append", default=[], help="extra recipe override for every arm")
    ap.add_argument("--plot-only", metavar="JSON", help="only draw the PNG of an earlier run's JSON (beside it)")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot_only).with_suffix(".png"))
        return 0
    t_begin = time.time()
    base = BENCH + (TINY + TINY_TASK[args.task] if args.tiny else []) + args.set
    if args.steps:
        base.append(f"grpo.max_num_steps={args.steps}")
    base.append(f"validation.val_period={args.eval_every}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="e2e_"))
    res: dict = {"task": args.task, "device": args.device, "overrides": base, "arms": {}, "budget_s": args.budget_s}
    try:
        import torch

        res["gpu"] = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        res["torch"] = torch.__version__
    except Exception as exc:  # report, do not hide
        res["gpu"] = f"unknown ({exc})"
    sampler = GpuSampler(tmp / "util.csv") if args.device == "cuda" else None
    try:
        policy, res["policy"] = build_policy(args, tmp, base + [f"output_dir={tmp}", "run_name=init"])
        print(f"initial policy: {res['policy']['num_parameters']:,} parameters, warm-up "
              f"{res['policy']['warmup'].get('steps')} steps to {res['policy']['warmup'].get('accuracy')} in "
              f"{res['policy']['wall_s']:.0f}s", flush=True)
        seeds = [int(s) for s in args.seeds.split(",") if s]
        plan = []
        for arm in args.arms.split(","):
            if arm == "refit":
                plan.append(("refit", "refit", []))
            elif arm == "async":
                plan.append(("rlcore", "rlcore_async_s0", ["async_rl.sampler.max_lookahead_versions=1"]))
            elif arm == "sync":
                plan.append(("rlcore", "rlcore_sync_s0", ["async_rl.sampler.max_lookahead_versions=0"]))
            elif arm == "trl":
                plan += [("trl", f"trl_s{s}", [f"grpo.seed={s}"]) for s in seeds]
            elif arm == "eager":  # the async arm with the trainer uncompiled (no compilation to pay)
                plan.append(("rlcore", "rlcore_async_eager_s0", ["async_rl.sampler.max_lookahead_versions=1",
                                                                 "trainer.compile=false"]))
            elif arm == "async1":
                plan.append(("rlcore", "rlcore_async_s1", ["async_rl.sampler.max_lookahead_versions=1", "grpo.seed=1"]))
        for kind, name, extra in plan:
            left = args.budget_s - (time.time() - t_begin)
            share = min(left, args.arm_cap_s.get(kind, left))
            sets = base + extra + [f"output_dir={tmp}", f"run_name={name}"]
            print(f"[{name}] starting, {share:.0f}s allowed", flush=True)
            r = run_child(kind, args, tmp, name, sets, policy, share)
            if kind != "refit":
                busy = sampler.busy(r["t_start"], r["t_end"]) if sampler and "t_start" in r else None
                r = summarize(r, busy)
            res["arms"][name] = r
            print(f"[{name}] " + json.dumps({k: v for k, v in r.items() if k not in ("curve", "trl_args", "log")})[:600],
                  flush=True)
            if "log" in r:
                print(r["log"][-1500:], flush=True)
    except Exception as exc:
        import traceback

        res["error"] = traceback.format_exc()
        print(res["error"], flush=True)
    finally:
        if sampler:
            sampler.stop()
    report(res)
    (out_dir / f"e2e_{args.task}.json").write_text(json.dumps(res, indent=1))
    try:
        plot(res, out_dir / f"e2e_{args.task}.png")
    except Exception as exc:
        print("plot failed:", exc)
    res["wall_s"] = time.time() - t_begin
    print(f"total {res['wall_s']:.0f}s")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def report(res: dict) -> None:
    arms = res["arms"]
    trl = [r for n, r in arms.items() if n.startswith("trl") and r.get("curve")]
    trl_final = statistics.mean(r["curve"][-1]["accuracy"] for r in trl) if trl else None
    trl_time = statistics.mean(r["train_wall_s"] for r in trl) if trl else None
    print(f"\n{res['task']} on {res['gpu']}")
    print(f"{'arm':18s} {'steps':>5s} {'s/step':>7s} {'gen tok/s':>10s} {'train tok/s':>11s} {'GPU busy':>8s} "
          f"{'acc0':>5s} {'final':>5s} {'peak GiB':>8s} {'t->TRL final':>12s}")
    for name, r in arms.items():
        if name == "refit" or "s_per_step" not in r:
            continue
        tt = time_to(r["curve"], trl_final) if trl_final is not None else None
        r["time_to_trl_final_s"] = tt
        if tt and trl_time:
            r["speedup_vs_trl"] = trl_time / tt if tt > 0 else None
        busy = f"{r['gpu_busy']:.2f}" if r.get("gpu_busy") is not None else "-"
        print(f"{name:18s} {r['steps']:5d} {r['s_per_step']:7.2f} {r['gen_tokens_per_s']:10.0f} "
              f"{r['trained_tokens_per_s']:11.0f} {busy:>8s} {r['curve'][0]['accuracy']:5.3f} "
              f"{r['curve'][-1]['accuracy']:5.3f} {r.get('peak_allocated_gib', 0):8.1f} "
              f"{(f'{tt:.1f}s' if tt is not None else '-'):>12s}")
    for name, r in arms.items():
        if "failed" in r or "skipped" in r:
            print(f"{name}: {r.get('failed') or r.get('skipped')}")
    f = arms.get("refit", {})
    if "on_device_s" in f:
        print(f"refit {f['bytes'] / 1e6:.0f} MB: on device {f['on_device_s']:.4f}s ({f['on_device_gb_s']:.1f} GB/s), "
              f"CPU round trip {f['cpu_round_trip_s']:.4f}s ({f['cpu_round_trip_gb_s']:.1f} GB/s); device copy "
              f"{f['device_copy_gb_s']:.0f} GB/s")
    res["trl_final_accuracy_mean"] = trl_final
    if len(trl) >= 2:  # correctness across systems: the final check against TRL's seed-to-seed spread
        lo, hi = min(r["curve"][-1]["accuracy"] for r in trl), max(r["curve"][-1]["accuracy"] for r in trl)
        for name, r in arms.items():
            if name.startswith("rlcore") and r.get("curve"):
                acc = r["curve"][-1]["accuracy"]
                r["within_trl_seed_spread"] = lo <= acc <= hi
                print(f"{name}: final {acc:.3f}, TRL's seeds {lo:.3f}..{hi:.3f}: "
                      f"{'within' if lo <= acc <= hi else 'outside'}")


if __name__ == "__main__":
    sys.exit(main())
