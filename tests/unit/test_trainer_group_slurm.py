"""The trainer group's replacement across nodes, without a cluster (rl_core/launch/trainer_group.py,
`SlurmTrainerGroup`): the first step's layout read from Slurm's variables, the replacement step
(`srun --jobid --overlap`, its tasks placed by a host file, rank = 1 + SLURM_PROCID, local ranks
as before), a worker on another node killed by pid through a one-task step on its node (also by
the armed watchdog when it hangs), and the controller job's step that outlives a killed task.

`srun` here is a stand-in on PATH (tests/helpers/fake_srun.py: it records its options and runs
the command's tasks on this host with SLURM_PROCID and SLURMD_NODENAME set); the real one runs in
tests/workflow/test_multinode_slurm.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from rl_core.distributed import step_layout
from rl_core.launch.job import slurm_parameters
from rl_core.launch.preflight import load_recipe
from rl_core.launch.trainer_group import JOIN_KEY, SlurmTrainerGroup
from rl_core.launch.trainer_worker import task_rank
from rl_core.train.spmd import INIT, CommandChannel, WorkerLostError
from tests.helpers.trainers import Collective, channel_worker

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-addition-multinode.yaml"
FAKE_SRUN = ROOT / "tests" / "helpers" / "fake_srun.py"


@pytest.fixture
def srun_log(tmp_path, monkeypatch) -> Path:
    """`srun` on PATH is the stand-in; returns the file where it records each call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE_SRUN} \"$@\"\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    log = tmp_path / "srun.jsonl"
    monkeypatch.setenv("FAKE_SRUN_LOG", str(log))
    return log


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def group(tmp_path: Path, layout: list[tuple[str, int]]) -> SlurmTrainerGroup:
    return SlurmTrainerGroup(load_recipe(str(RECIPE)), layout=layout, job_id="77", world_size=len(layout),
                             device="cpu", build=lambda at: None, group_dir=tmp_path / "trainer_group")


def test_the_first_steps_layout_from_slurms_variables():
    two = {"SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    assert step_layout(two) == [("node1", 0), ("node2", 0)]
    uneven = {"SLURM_STEP_NODELIST": "gpu[07-08],login", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"}
    assert step_layout(uneven) == [("gpu07", 0), ("gpu07", 1), ("gpu08", 0), ("gpu08", 1), ("login", 0)]
    with pytest.raises(ValueError, match="not inside a Slurm job step"):
        step_layout({"SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1"})


def test_a_replacement_task_takes_its_rank_from_its_step():
    assert task_rank(3, None, None, None) == (3, 3)  # a plain process (one host)
    env = {"SLURM_PROCID": "1"}
    assert task_rank(None, 1, None, "1,0,1", environ=env) == (2, 0)
    assert task_rank(None, 1, None, None, environ=env) == (2, 2)


def test_replacement_ranks_start_as_one_overlapping_step_laid_out_as_before(tmp_path, srun_log, monkeypatch):
    """Ranks 1..2 of a 3-rank group over node1 (ranks 0, 1) and node2 (rank 2): one step, its tasks
    placed by the host file, each joining rank 0's new store under its own rank."""
    import torch.distributed as dist

    monkeypatch.setenv("SLURM_NTASKS", "3")  # rank 0's own step: must not shape the new one
    monkeypatch.setenv("RL_CORE_TRAINER_FAULT", "finish:1:KILL")  # a drill is not passed on
    g = group(tmp_path, [("node1", 0), ("node1", 1), ("node2", 0)])
    g.restarts = 1
    store = dist.TCPStore("0.0.0.0", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    g._spawn(store.port)
    try:
        g._await_join(store, time.monotonic() + 120)
        (step,) = calls(srun_log)
        assert step["opts"][:3] == ["--jobid=77", "--overlap", "--nodes=2"]
        assert {"--ntasks=2", "--distribution=arbitrary", "--kill-on-bad-exit=1", "--cpus-per-task=1",
                "--job-name=rl_core-trainer-ranks-1"} <= set(step["opts"])
        assert step["hostfile"] == "node1\nnode2\n"
        assert step["env"]["SLURM_NTASKS"] is None and step["env"]["RL_CORE_TRAINER_FAULT"] is None
        assert step["cmd"][1:3] == ["-m", "rl_core.launch.trainer_worker"]
        assert [int(store.get(f"{JOIN_KEY}{r}")) > 0 for r in (1, 2)] == [True, True]
        log = (tmp_path / "trainer_group" / "restart1.log").read_text()
        assert "[trainer_worker] rank 1 (local rank 1) on " in log and "[trainer_worker] rank 2 (local rank 0) on " in log
    finally:
        for p in g.procs:
            p.terminate()  # the stand-in ends its tasks, as srun forwards SIGTERM
        g._stop_procs()


def test_a_worker_on_another_node_is_killed_through_a_step_on_its_node(tmp_path, srun_log):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        g = group(tmp_path, [("node1", 0), ("node2", 0), ("node2", 1), ("node3", 0)])
        missed = g.kill_far({1: {"host": "node2", "pid": victim.pid, "node": "node2"},
                             3: {"host": "node3.cluster", "pid": 2 ** 22 + 7},  # node from the layout; gone already
                             2: {}})  # never said where it runs
        assert victim.wait(10) == -signal.SIGKILL
        assert missed == [2]
        by_node = {next(o for o in c["opts"] if o.startswith("--nodelist=")): c for c in calls(srun_log)}
        assert sorted(by_node) == ["--nodelist=node2", "--nodelist=node3"]
        assert by_node["--nodelist=node2"]["cmd"][-1] == str(victim.pid)
        assert {"--jobid=77", "--overlap", "--ntasks=1"} <= set(by_node["--nodelist=node2"]["opts"])
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait()


def test_the_armed_watchdog_kills_a_hung_worker_on_another_node(tmp_path, srun_log):
    with channel_worker() as (store, worker):
        driver = CommandChannel(0, 2, store=store, timeout_s=600, heartbeat_timeout_s=3.0)
        g = group(tmp_path, [("node1", 0), ("node2", 0)])
        driver.complete(driver.publish(INIT))
        driver.call(Collective(), "noop")  # a working group (its heartbeat started)
        g.arm(type("Trainer", (), {"channel": driver})())
        assert driver.recoverable and driver.kill_far == g.kill_far
        # it runs on node2 as far as rank 0 knows (the worker posted its real host once)
        assert driver.store.check(["who/1"])
        driver.store.set("who/1", json.dumps({"host": "node2", "pid": worker.pid, "node": "node2"}))
        os.kill(worker.pid, signal.SIGSTOP)  # hung: no heartbeat, the collective waits for it
        with pytest.raises(WorkerLostError, match=r"trainer worker rank 1 \(host node2, pid %d\)" % worker.pid):
            driver.call(Collective(), "wait", worker.pid)
        assert worker.wait(10) == -signal.SIGKILL  # killed through a step on node2; this process lives on
        kill = calls(srun_log)[0]
        assert "--job-name=rl_core-trainer-kill" in kill["opts"] and kill["cmd"][-1] == str(worker.pid)
        driver.abandon()


def test_the_controller_jobs_step_outlives_a_killed_task_when_recovery_is_on():
    from submitit.slurm.slurm import _make_sbatch_string

    c = load_recipe(str(RECIPE)).cluster
    srun = {}
    for recovery in (True, False):
        params = slurm_parameters(c.controller, c, "rl_core-train-x-e1", recovery=recovery)
        script = _make_sbatch_string(command="python -m submitit.core._submit F", folder="/tmp/f", **params)
        srun[recovery] = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=0 --wait=0" in srun[True]
    assert "--kill-on-bad-exit" not in srun[False]  # max_restarts: 0: the cluster's KillOnBadExit, as before
    assert "srun_args" not in slurm_parameters(c.evaluation, c, "x", recovery=True)
    one = load_recipe(str(RECIPE), ["cluster.generation=null", "generation.http.num_local_servers=1",
                                    "cluster.controller.nodes=1", "cluster.trainer=null"]).cluster
    assert "srun_args" not in slurm_parameters(one.controller, one, "x", recovery=True)  # one task: nothing to outlive


def test_the_fake_srun_is_on_path(srun_log):
    """The stand-in answers as `srun` here (a guard: the tests above must not reach a real cluster)."""
    out = subprocess.run(["srun", "--jobid=1", "--overlap", "/bin/echo", "ok"], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout == "ok\n" and calls(srun_log)[0]["cmd"] == ["/bin/echo", "ok"]
