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
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "tests" / "recipes" / "tiny-addition-loop.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, name: str, args: list[str], fault: str | None = None) -> tuple[float, int, str]:
    """`rl-core train` as 2 ranks; returns (wall seconds, rank 0's exit code, its output)."""
    cmd = [sys.executable, "-m", "rl_core.launch.cli", "train", str(RECIPE), f"output_dir={out}", f"run_name={name}",
           *args]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    base.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    t0 = time.monotonic()
    procs = []
    for rank in (0, 1):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        if fault and rank == 1:
            env["RL_CORE_TRAINER_FAULT"] = fault
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    text, _ = procs[0].communicate()
    wall = time.monotonic() - t0
    for p in procs[1:]:
        if p.poll() is None:
            p.kill()
        p.communicate()
    return wall, procs[0].returncode, text


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--fault-version", type=int, default=6)
    ap.add_argument("--heartbeat-s", type=float, default=4.0)
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
        sys.path.insert(0, str(ROOT))
        from rl_core.launch.preflight import load_recipe
        from rl_core.launch.train import ensure_policy, setup_process

        cfg = load_recipe(RECIPE)
        setup_process(cfg)
        policy = ensure_policy(cfg, out / "policy")
    for name in ("ref", "recovered", "restarted"):
        shutil.copytree(policy, out / name / "init_policy")
    ref, rc, _ = launch(out, "ref", args)
    assert rc == 0
    rec, rc, text = launch(out, "recovered", args, fault)
    assert rc == 0, text[-3000:]
    failed, rc, _ = launch(out, "restarted", args + ["trainer.recovery.max_restarts=0"], fault)
    assert rc != 0
    resumed, rc, text2 = launch(out, "restarted", args)
    assert rc == 0 and "[resume] continuing from" in text2, text2[-3000:]
    (r,) = json.loads((out / "recovered" / "summary.json").read_text())["trainer_recoveries"]
    same = all((out / n / "final_policy" / "model.safetensors").read_bytes()
               == (out / "ref" / "final_policy" / "model.safetensors").read_bytes() for n in ("recovered", "restarted"))
    print(json.dumps({
        "uninterrupted_s": round(ref, 1), "recovered_run_s": round(rec, 1),
        "failed_then_resumed_s": [round(failed, 1), round(resumed, 1)],
        "lost_in_job_recovery_s": round(rec - ref, 1), "lost_full_restart_s": round(failed + resumed - ref, 1),
        "recovery_record": {k: r[k] for k in ("seconds_lost", "restart_s", "replay_s", "replayed_steps",
                                              "restored_version")},
        "heartbeat_timeout_s": a.heartbeat_s, "final_weights_equal": same}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
