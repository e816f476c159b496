"""Seconds lost to a lost trainer rank: in-job recovery (`trainer.recovery`) vs a full job restart.

The same run four times (fsdp2 over 2 ranks started as plain processes, the loop tests' recipe,
CPU): uninterrupted; rank 1 SIGKILLed in the middle of RL step `--fault-version + 1` and the
group replaced in the job; the same fault with `trainer.recovery.max_restarts=0` (the job fails)
and then the same command again, which resumes from the newest step checkpoint (the CLI's
resume path: start-up, model load, generation spin-up). Prints wall times and the losses
against the uninterrupted run. docs/benchmarks.md holds the figures.

    python bench/trainer_recovery.py [--steps 8] [--save-every 4] [--fault-version 6]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.helpers.trainers import train_as_ranks  # noqa: E402

RECIPE = ROOT / "tests" / "recipes" / "tiny-addition-loop.yaml"


def launch(out: Path, name: str, args: list[str], fault: str | None = None) -> tuple[float, int, str]:
    """`rl-core train` as 2 ranks; returns (wall seconds, rank 0's exit code, its output)."""
    rc, text, wall = train_as_ranks(out, name, [str(RECIPE), *args], fault, timeout_s=1800)
    return wall, rc, text


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--fault-version", type=int, default=6)
    ap.add_argument("--heartbeat-s", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--policy", help="an initial policy directory to reuse (default: built once here)")
    a = ap.parse_args()
    args = [f"grpo.max_num_steps={a.steps}", f"checkpoint.save_every_steps={a.save_every}",
            "async_rl.reproducible=true", "trainer.backend=fsdp2", "validation.val_at_start=false",
            "validation.val_at_end=false", "logging.tensorboard=false",
            f"trainer.worker_heartbeat_timeout_s={a.heartbeat_s}"]
    fault = f"train_microbatches:{a.fault_version}:KILL"
    out = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    policy = Path(a.policy) if a.policy else None
    if policy is None:
        from rl_core.launch.preflight import load_recipe
        from rl_core.launch.train import ensure_policy, setup_process

        cfg = load_recipe(RECIPE)
        setup_process(cfg)
        policy = ensure_policy(cfg, out / "policy")
    rows = []
    for rep in range(a.repeat):  # the three arms interleaved, so that the machine's load hits each alike
        names = {arm: f"{arm}{rep}" for arm in ("ref", "recovered", "restarted")}
        for name in names.values():
            shutil.copytree(policy, out / name / "init_policy")
        ref, rc, _ = launch(out, names["ref"], args)
        assert rc == 0
        rec, rc, text = launch(out, names["recovered"], args, fault)
        assert rc == 0, text[-3000:]
        failed, rc, _ = launch(out, names["restarted"], args + ["trainer.recovery.max_restarts=0"], fault)
        assert rc != 0
        resumed, rc, text2 = launch(out, names["restarted"], args)
        assert rc == 0 and "[resume] continuing from" in text2, text2[-3000:]
        summary = json.loads((out / names["recovered"] / "summary.json").read_text())
        (r,) = summary["trainer_recoveries"]
        resumed_summary = json.loads((out / names["restarted"] / "summary.json").read_text())
        final = {n: (out / names[n] / "final_policy" / "model.safetensors").read_bytes() for n in names}
        rows.append({
            "uninterrupted_s": round(ref, 1), "recovered_run_s": round(rec, 1),
            "failed_then_resumed_s": [round(failed, 1), round(resumed, 1)],
            "lost_in_job_recovery_s": round(rec - ref, 1), "lost_full_restart_s": round(failed + resumed - ref, 1),
            "resumed_process_start_up_s": round(resumed - resumed_summary["wall_s"], 1),
            "recovery_record": {k: round(r[k], 2) if isinstance(r[k], float) else r[k]
                                for k in ("seconds_lost", "restart_s", "replay_s", "replayed_steps", "restored_version")},
            "train_idle_s": {"uninterrupted": round(json.loads((out / names["ref"] / "summary.json").read_text())
                                                    ["train_idle_s"], 1), "recovered": round(summary["train_idle_s"], 1)},
            "final_weights_equal": final["recovered"] == final["ref"] == final["restarted"]})
    print(json.dumps({"heartbeat_timeout_s": a.heartbeat_s, "runs": rows}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
