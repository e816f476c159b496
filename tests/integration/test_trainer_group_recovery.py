"""In-job recovery of the trainer group (`trainer.recovery`, docs/cluster.md "Failures"), on CPU:
fsdp2 over 2 ranks started as two plain processes (as Slurm or submitit start tasks: no agent
that ends rank 0 when rank 1 dies). Rank 1 is SIGKILLed, or SIGSTOPped (a hang), in the middle
of an RL step after the newest step checkpoint (`RL_CORE_TRAINER_FAULT`); the run replaces the
group within the deadline and finishes, every group is trained exactly once (group ids of
rollouts.h5), the replayed step is reported, and with `async_rl.reproducible: true` the final
weights equal an uninterrupted run's bit for bit. Counted in RL steps."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from rl_core.metrics.logger import read_jsonl
from tests.helpers.trainers import train_as_ranks

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "tests" / "recipes" / "tiny-addition-loop.yaml"
STEPS = 5  # checkpoints at steps 2 and 4; the fault in RL step 4: step 3 is replayed from step 2's checkpoint
HEARTBEAT_S = 4.0
ARGS = [f"grpo.max_num_steps={STEPS}", "checkpoint.save_every_steps=2", "async_rl.reproducible=true",
        "trainer.backend=fsdp2", "validation.val_at_start=false", "validation.val_at_end=false",
        "logging.tensorboard=false", f"trainer.worker_heartbeat_timeout_s={HEARTBEAT_S}",
        "trainer.recovery.restart_deadline_s=120"]

pytestmark = pytest.mark.slow


def launch(tmp_path: Path, policy: Path, name: str, fault: str | None = None, *extra: str) -> tuple[Path, str]:
    """The run as 2 ranks (`fault` on rank 1); returns the run directory and rank 0's output."""
    run_dir = tmp_path / name
    shutil.copytree(policy, run_dir / "init_policy")
    rc, out, _ = train_as_ranks(tmp_path, name, [str(RECIPE), *ARGS, *extra], fault)
    assert rc == 0, out[-6000:]
    return run_dir, out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _trained_groups(run_dir: Path) -> list[str]:
    import h5py

    with h5py.File(run_dir / "rollouts.h5", "r") as f:
        return list(f["groups"]["group_id"].asstr()[:])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, warm_policy) -> Path:
    run_dir, _ = launch(tmp_path_factory.mktemp("ref"), warm_policy, "ref")
    return run_dir


@pytest.mark.parametrize("signal_name", ["KILL", "STOP"])
def test_a_lost_rank_is_replaced_in_the_job(tmp_path, warm_policy, reference, signal_name):
    run_dir, out = launch(tmp_path, warm_policy, f"lost-{signal_name.lower()}", f"train_microbatches:3:{signal_name}")
    assert "[recovery] replacing the trainer group (1/2)" in out, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rl_steps"] == STEPS
    (rec,) = summary["trainer_recoveries"]
    assert "rank 1" in rec["lost"] and rec["during"] == "train_microbatches", rec
    assert rec["restored_version"] == 2 and rec["replayed_steps"] == [3] and rec["version"] == 3, rec
    assert rec["restart_s"] < 120 and rec["seconds_lost"] >= HEARTBEAT_S
    rows = read_jsonl(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["recovery/count_total"] for r in rows] == [0, 0, 0, 1, 1]
    assert rows[3]["recovery/replayed_steps"] == 1 and rows[3]["recovery/seconds_lost"] > 0
    # every group trained exactly once, the same groups in the same steps as without the fault
    got, want = _trained_groups(run_dir), _trained_groups(reference)
    assert len(got) == len(set(got)) == STEPS * 16
    assert got == want
    assert _sha(run_dir / "final_policy" / "model.safetensors") == _sha(reference / "final_policy" / "model.safetensors")
    assert not list((run_dir / "trainer_group").glob("rank1.restart2*")), "one replacement only"


def test_without_recovery_the_job_fails_naming_the_rank(tmp_path, warm_policy):
    """`trainer.recovery.max_restarts: 0`: fail fast, as before recovery existed; the step checkpoint stays."""
    with pytest.raises(AssertionError) as failed:
        launch(tmp_path, warm_policy, "failfast", "train_microbatches:2:KILL", "trainer.recovery.max_restarts=0",
               "grpo.max_num_steps=3")
    text = str(failed.value)
    assert "WorkerLostError" in text and "trainer worker rank 1 (host" in text, text[-3000:]
    assert "[recovery]" not in text
    assert (tmp_path / "failfast" / "steps" / "step_000002" / "manifest.json").is_file()
