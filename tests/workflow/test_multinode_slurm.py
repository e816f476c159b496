"""The workflow on three Slurm nodes, simulated on this host (ci/slurm-local with
SLURM_LOCAL_NODES=3: each node a network namespace with its own host name, address and
slurmd; docs/cluster.md), with `--profile profiles/slurm` and recipes/tiny-addition-multinode.yaml:
the controller job is one allocation of node[1-3]; its trainer step runs a 2-rank fsdp2
group on node1 and node2; rank 0 starts `rl-core serve` as a job step on node3 and refits it
by broadcast across nodes. Marked `slurm` and `slow`; needs root (skipped with the reason).
One module fixture drives two runs, overlapped so that one trains while the other waits:
1. The whole workflow (its initial policy reused, one epoch of 24 RL steps), with fault (a):
   the generation server on node3 is SIGKILLed while a generation request is in flight, after
   step 4 (`_kill_in_flight`: provably); the run goes on (a retry; the server relaunched and
   caught up by a new broadcast group), every prompt group trains exactly once, every refit
   crossed nodes, `sacct` shows the job and its steps on the intended nodes, the outputs have
   the local run's layout, and held-out accuracy rises (3 seeds measured: docs/benchmarks.md).
   The recipe's warm-up (to 50%) runs once, before both runs.
2. The same epoch from run 1's initial policy (`trainer.recovery.max_restarts: 1`), with faults
   (r), (b) and (c): (r) trainer rank 1 (node2) SIGKILLed after 2 steps: rank 0 replaces the
   group inside the job (a new `srun --overlap` step on node2, the steps since the base replayed)
   within the deadline, and the epoch goes on; (b) the replacement rank 1 (node2) SIGKILLed at
   the first step checkpoint, while run 1 trains: past the budget, the controller job fails
   within the heartbeat deadline with an error naming rank 1; once run 1's epoch has left the
   nodes, the same command again resumes from the newest step checkpoint; (c) during that
   rerun node2's slurmd is stopped: slurmctld sets node2 DOWN after SlurmdTimeout, the job
   ends NODE_FAIL and is requeued, pending until node2 is back (up.sh starts its slurmd
   again), then resumes and the workflow finishes by itself. The generation server is paused
   (SIGSTOP) meanwhile, only so the epoch is still running when slurmctld notices. Its final
   weights equal run 1's bit for bit: every run of this reproducible recipe is a function of
   its seeds, so two runs with different faults that agree both equal an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.workflow import ROOT, make_workdir, manifest, slurm_local, snakemake

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
RECIPE, RUN = "recipes/tiny-addition-multinode.yaml", "multinode"
PROFILE = str(ROOT / "profiles" / "slurm")
STEPS, PROMPTS_PER_STEP, SAVE_EVERY = 24, 8, 8
SLURM_RUN = Path(os.environ.get("SLURM_LOCAL_DIR", "/var/lib/slurm-local")) / "run"


def _config(run: str, *overrides: str) -> list[str]:
    extra = ["overrides=" + json.dumps(overrides)] if overrides else []
    return ["--config", f"recipe={RECIPE}", f"run={run}", *extra]


def _train_steps(metrics: Path) -> list[dict]:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return []
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


def _wait(predicate, timeout: float, proc=None, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc is None or proc.poll() is None, f"snakemake ended ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"not reached within {timeout:.0f}s: {what}"
        time.sleep(0.2)


def _job_id(epoch_dir: Path) -> str:
    return str(json.loads((epoch_dir / "submitit" / "job.json").read_text())["job_id"])


def _sacct(job_id: str, *flags: str) -> list[dict]:
    out = subprocess.run(["sacct", "-j", job_id, "-n", "-P", *flags, "-o", "JobID,JobName%40,NodeList,NTasks,State"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    keys = ("id", "name", "nodes", "ntasks", "state")
    return [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]


def _finished(rows: list[dict]) -> bool:
    return bool(rows) and not any(r["state"] in ("RUNNING", "PENDING", "COMPLETING") for r in rows)


def _stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _output(proc, log, timeout: float, ok: bool = True) -> str:
    """Wait for snakemake (killed with its jobs' waiters after `timeout`); its output, checked."""
    try:
        proc.wait(timeout=timeout)
    finally:
        _stop(proc)
    log.seek(0)
    out = log.read()
    assert (proc.returncode == 0) == ok, out[-6000:]
    return out


def _layout(run_dir: Path) -> set[str]:
    """The run's outputs by kind: top-level entries, and those of each epoch and checkpoint."""
    out = {re.sub(r"^epoch_\d+$", "epoch_k", p.name) for p in run_dir.iterdir() if not p.name.startswith(".")}
    for e in run_dir.glob("epoch_*"):
        out |= {f"epoch/{p.name}" for p in e.iterdir() if p.name != "submitit"}
        out |= {f"checkpoint/{p.relative_to(e / 'checkpoint')}" for p in (e / "checkpoint").rglob("*")}
    out |= {f"logs/{re.sub(r'_[0-9]+$', '_k', p.stem)}" for p in (run_dir / "logs").iterdir()}
    return out


_PIDFD_GETFD = 438  # the syscall's number (one table for every architecture since Linux 5.1)
HOLD_S = 3.0  # a stop's longest hold: far below the health check's timeout (connect_timeout_s, 10 s)


def _unread_requests(pid: int, port: int) -> list[bytes]:
    """The first line of each HTTP request that process `pid` holds unread on an established
    connection to its `port`: the sockets of its network namespace (/proc/<pid>/net/tcp) with
    data in their receive queue, each one of its descriptors, read through a copy (pidfd_getfd)
    with MSG_PEEK, which leaves the data in place; the copy is closed at once (the process's own
    descriptor keeps the connection as it was)."""
    queued = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        f = line.split()  # sl local rem st tx:rx ... inode
        if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "01" and int(f[4].split(":")[1], 16) > 0:
            queued.add(f"socket:[{f[9]}]")
    out: list[bytes] = []
    if not queued:
        return out
    libc, pidfd = ctypes.CDLL(None, use_errno=True), os.pidfd_open(pid)
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") not in queued:
                    continue
            except OSError:  # closed meanwhile
                continue
            copy = libc.syscall(_PIDFD_GETFD, pidfd, int(fd), 0)
            if copy < 0:
                err = ctypes.get_errno()
                if err == 9:  # EBADF: closed meanwhile
                    continue
                raise OSError(err, f"pidfd_getfd of fd {fd} of pid {pid}: {os.strerror(err)} (the test runs as root)")
            with socket.socket(fileno=copy) as sock:
                try:
                    out.append(sock.recv(256, socket.MSG_PEEK | socket.MSG_DONTWAIT).split(b"\r\n", 1)[0])
                except OSError:
                    continue
    finally:
        os.close(pidfd)
    return out


def _kill_in_flight(pid: int, port: int, metrics: Path, stop: threading.Event, timeout: float) -> dict:
    """Fault (a): SIGKILL generation server `pid` while a generation request is provably in flight.

    At each new record of `metrics` (a step's end: its refit has loaded the new version, and the
    next step's first group is dispatched only after the record is written) the server is
    stopped (SIGSTOP); it is killed once it holds, unread, a `POST /v1/completions` on an
    established connection (`_unread_requests`). A stopped process reads nothing, so that request
    got no answer: the kill resets its connection and the controller's HTTP backend retries it
    (`generation/retries`). Only the controller talks to the server (its token), and with one
    group in flight (async_rl.max_inflight_groups) a request unread is one the controller waits
    on. The requests the controller sends besides (GET /health, GET /rl/metrics, the refit's
    POST /rl/receive_weights) are not generation requests and do not count. Where none comes
    within HOLD_S (the stop fell while a request was already being answered, or during a
    refit or a checkpoint) the server continues (SIGCONT) and the next step's end tries again:
    held shorter than every timeout of the controller, a stop only delays the run (the server
    runs in lockstep: no result depends on timing)."""
    deadline, attempts = time.monotonic() + timeout, 0
    size = metrics.stat().st_size
    while not stop.is_set():
        assert time.monotonic() < deadline, f"no generation request caught in flight in {attempts} stops"
        assert not (metrics.parent / "summary.json").exists(), f"the epoch ended first ({attempts} stops)"
        if metrics.stat().st_size == size:
            time.sleep(0.003)
            continue
        size, attempts = metrics.stat().st_size, attempts + 1
        os.kill(pid, signal.SIGSTOP)
        t_stop, wall_stop, killed = time.monotonic(), time.time(), False
        try:
            while time.monotonic() < t_stop + HOLD_S:
                lines = _unread_requests(pid, port)
                if any(line.startswith(b"POST /v1/completions ") for line in lines):
                    os.kill(pid, signal.SIGKILL)
                    killed = True
                    steps = _train_steps(metrics)  # the margins: record -> stop -> the request seen
                    return {"attempts": attempts, "unread": lines, "after_step": len(steps),
                            "record_to_stop_s": wall_stop - steps[-1]["time"],
                            "stop_to_request_s": time.monotonic() - t_stop}
                time.sleep(0.005)
        finally:
            if not killed:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile: the run's error tells why
                    os.kill(pid, signal.SIGCONT)
    raise AssertionError(f"stopped before a generation request was caught in flight ({attempts} stops)")


class _Run:
    """One snakemake run in the background: its results directory and its log."""

    def __init__(self, wd: Path, run: str, *args: str):
        self.dir = wd / "results" / run
        self.log = open(wd.parent / f"snakemake-{run}-{time.monotonic_ns()}.out", "w+")  # noqa: SIM115
        self.proc = snakemake(wd, "--profile", PROFILE, *args, popen=True, stdout=self.log)

    def output(self, timeout: float, ok: bool = True) -> str:
        return _output(self.proc, self.log, timeout, ok)


@pytest.fixture(scope="module")
def runs(multinode_cluster, tmp_path_factory):
    """Run 1 (the whole workflow, fault a) and run 2 (faults b and c), overlapped: what each saw."""
    seen: dict = {}
    t0 = time.monotonic()
    base = tmp_path_factory.mktemp("multinode")
    wd1, wd2 = make_workdir(base / "wd"), make_workdir(base / "wd-faults")
    # the recipe's warm-up, once: both runs' init_policy rules take it (model.warmup.reuse_from)
    init = base / "init_policy"
    built = subprocess.run([sys.executable, "-m", "rl_core.launch.cli", "init-policy", RECIPE, "--out", str(init)],
                           cwd=wd1, capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    seen["warmup_s"] = time.monotonic() - t0
    reuse = f"model.warmup.reuse_from={init}"
    name2 = "multinode-faults"
    # one replacement of the trainer group allowed: the first lost rank is replaced, the second fails the job
    args2 = (f"results/{name2}/epoch_1/summary.json", *_config(name2, reuse, "trainer.recovery.max_restarts=1"))
    run1, run2 = _Run(wd1, RUN, *_config(RUN, reuse)), _Run(wd2, name2, *args2)  # side by side
    r1, e1, r2, e2 = run1.dir, run1.dir / "epoch_1", run2.dir, run2.dir / "epoch_1"
    stop_a, pool = threading.Event(), ThreadPoolExecutor(1)
    try:
        # (r) run 2's trainer rank 1 on node2 (task 1 of the job's first step), SIGKILLed after 2 steps:
        # rank 0 replaces it by a new job step on node2 and the epoch goes on
        _wait(lambda: len(_train_steps(e2 / "metrics.jsonl")) >= 2, 900, run2.proc, "run 2 trained 2 steps")
        job = seen["job_b"] = _job_id(e2)
        task1 = (e2 / "submitit" / f"{job}_1_log.out").read_text()
        first = seen["rank1_first"] = int(re.search(r"\[job\] node2 pid (\d+)", task1).group(1))
        os.kill(first, signal.SIGKILL)
        t_kill = time.monotonic()
        _wait(lambda: len(_train_steps(e1 / "metrics.jsonl")) >= 4, 900, run1.proc, "run 1 trained 4 steps")
        ready = seen["ready"] = json.loads((r1 / "servers" / "server0.ready.json").read_text())
        # fault (a): the generation node's server, killed from a thread of its own (it waits for a
        # step's end) while (b) goes on
        fault_a = pool.submit(_kill_in_flight, ready["pid"], ready["port"], e1 / "metrics.jsonl", stop_a, 900)
        task0 = e2 / "submitit" / f"{job}_0_log.out"
        _wait(lambda: "[recovery] trainer group replaced" in task0.read_text(), 300, run2.proc, "the replacement")
        seen["replaced_after"] = time.monotonic() - t_kill
        print(f"[recovery] run 2's trainer group replaced {seen['replaced_after']:.1f}s after the kill")
        # (b) the replacement rank 1 (node2), SIGKILLed after the first step checkpoint: past the budget
        _wait(lambda: (e2 / "steps" / f"step_{SAVE_EVERY:06d}" / "manifest.json").is_file(), 900, run2.proc,
              "run 2's first step checkpoint")
        seen["metrics_b"] = _train_steps(e2 / "metrics.jsonl")
        replacement = (e2 / "trainer_group" / "restart1.log").read_text()
        rank1 = seen["rank1"] = int(re.search(r"\[trainer_worker\] rank 1 \(local rank 0\) on node2 pid (\d+)",
                                              replacement).group(1))
        os.kill(rank1, signal.SIGKILL)
        t_kill = time.monotonic()
        seen["out_b"] = run2.output(600, ok=False)
        seen["failed_after"] = time.monotonic() - t_kill
        seen["task0_b"] = (e2 / "submitit" / f"{job}_0_log.out").read_text()
        print(f"[fault b] the workflow failed {seen['failed_after']:.1f}s after the kill")
        seen["fault_a"] = fault_a.result(timeout=900)
        a = seen["fault_a"]
        print(f"[fault a] killed after step {a['after_step']}, at stop {a['attempts']} (record -> stop "
              f"{a['record_to_stop_s']:.3f}s, stop -> request seen {a['stop_to_request_s']:.3f}s); unread: {a['unread']}")
        # (c) once run 1's epoch has left the nodes, the same command again; after it resumed
        # and saved a new checkpoint, node2's slurmd stops
        _wait(lambda: (e1 / "summary.json").is_file(), 900, run1.proc, "run 1's epoch")
        _wait(lambda: _finished(_sacct(_job_id(e1))), 120, None, "run 1's controller job ended")
        run2, t_rerun = _Run(wd2, name2, *args2), time.monotonic()
        slurmd_pid = int((SLURM_RUN / "slurmd.node2.pid").read_text())
        try:
            # a full restart's cost: the rerun, from its start to its first step trained
            _wait(lambda: len(_train_steps(e2 / "metrics.jsonl")) > SAVE_EVERY, 900, run2.proc, "the rerun's first step")
            seen["rerun_first_step_s"] = time.monotonic() - t_rerun
            print(f"[fault b] the rerun trained its first step {seen['rerun_first_step_s']:.1f}s after it started")
            _wait(lambda: (e2 / "steps" / f"step_{2 * SAVE_EVERY:06d}" / "manifest.json").is_file(), 900,
                  run2.proc, "a new step checkpoint")
            job2 = seen["job_c"] = _job_id(e2)
            assert job2 != job
            os.kill(slurmd_pid, signal.SIGTERM)
            t_stop = time.monotonic()
            os.kill(json.loads((r2 / "servers" / "server0.ready.json").read_text())["pid"], signal.SIGSTOP)
            _wait(lambda: any(row["state"] == "NODE_FAIL" for row in _sacct(job2, "--duplicates")), 300,
                  run2.proc, "the job's NODE_FAIL")
            seen["node_fail_after"] = time.monotonic() - t_stop
            _wait(lambda: "PENDING" in subprocess.run(["squeue", "-h", "-j", job2, "-o", "%T"], capture_output=True,
                                                      text=True).stdout, 60, run2.proc, "the job requeued")
            seen["checkpoint_before_resume"] = (e2 / "checkpoint").exists()
        finally:
            up = seen["up"] = slurm_local("up.sh", 3)  # node2's slurmd again (also when the test failed)
            if run2.proc.poll() is not None or up.returncode != 0:
                _stop(run2.proc)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        run2.output(900)
        print(f"[fault c] NODE_FAIL {seen['node_fail_after']:.1f}s after slurmd stopped")
        deadline = time.monotonic() + 60  # accounting records the end a little after the result file
        while not _finished(attempts := _sacct(job2, "--duplicates")) and time.monotonic() < deadline:
            time.sleep(2)
        seen["attempts"] = attempts
        run1.output(900)
    finally:
        stop_a.set()  # the fault (a) thread, if still waiting, lets the server continue and ends
        pool.shutdown(wait=True)
        for run in (run1, run2):
            if run is not None:
                _stop(run.proc)
    print(f"[multinode runs] {time.monotonic() - t0:.0f}s")
    return r1, r2, seen


def test_three_nodes_learn_on_the_intended_nodes(runs, reference_run):
    r, _, seen = runs
    before = json.loads((r / "init_validation.json").read_text())["accuracy"]
    after = json.loads((r / "epoch_1" / "validation.json").read_text())["accuracy"]
    assert after > before, f"held-out accuracy {before:.3f} -> {after:.3f} after {STEPS} RL steps"
    e = r / "epoch_1"
    job = _job_id(e)
    # the two trainer ranks ran on two hosts: each submitit task log names its host
    hosts = [re.search(r"\[job\] (\S+) pid \d+", (e / "submitit" / f"{job}_{t}_log.out").read_text()).group(1)
             for t in (0, 1)]
    assert hosts == ["node1", "node2"]
    deadline = time.monotonic() + 60  # accounting records the end of a step a little after it
    while not _finished(rows := _sacct(job)) and time.monotonic() < deadline:
        time.sleep(2)
    by_name = {}
    for row in rows:
        by_name.setdefault(row["name"], []).append(row)
    (alloc,) = by_name[f"rl_core-train-{RUN}-e1"]
    assert (alloc["nodes"], alloc["state"]) == ("node[1-3]", "COMPLETED"), rows
    trainer = [row for row in rows if row["id"] == f"{job}.0"]
    assert [(t["nodes"], t["ntasks"], t["state"]) for t in trainer] == [("node[1-2]", "2", "COMPLETED")], rows
    servers = by_name["rl_core-generation-0"]  # ended by the controller (SIGTERM through srun) or killed
    assert len(servers) == 2 and {s["nodes"] for s in servers} == {"node3"}, rows  # killed, relaunched
    # every refit crossed from node1 to node3: bytes and seconds of each. None found the server
    # down: it was killed while a group's request was in flight, and the next refit (barrier: a
    # reproducible run) waits for that group, which the relaunched server generated once caught up
    for step in _train_steps(e / "metrics.jsonl"):
        assert step["refit/bytes"] > 2e6 and step["refit/sync_broadcast_s"] > 0, step["step"]
        assert step["refit/sync_servers"] == 1 and step["refit/sync_recv_s"] > 0
    assert seen["ready"]["hostname"] == "node3"
    # the outputs are laid out as a local run's (servers/: the logs of the generation servers)
    assert _layout(r) - {"servers"} == _layout(reference_run / "results" / "short")


def test_a_killed_generation_server_loses_and_repeats_no_group(runs):
    import h5py

    r = runs[0]
    steps = _train_steps(r / "epoch_1" / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    last = steps[-1]
    assert last["generation/server_restarts"] == 1 and last["generation/retries"] >= 1
    assert last["refit/sync_groups_formed"] == 2  # a new broadcast group with the relaunched server
    log = (r / "servers" / "server0.log").read_text()
    assert log.count("--- launch ") == 2 and "--nodelist=node3" in log
    with h5py.File(r / "epoch_1" / "rollouts.h5", "r") as f:
        g = f["groups"]
        rows = list(zip(g["step"][:].tolist(), g["epoch"][:].tolist(), g["prompt_index"][:].tolist()))
    for s in range(1, STEPS + 1):
        assert len({(e, p) for st, e, p in rows if st == s}) == PROMPTS_PER_STEP == \
            sum(1 for st, _, _ in rows if st == s), f"step {s}"
    seen = [(e, p) for _, e, p in rows]
    assert len(seen) == len(set(seen)) == STEPS * PROMPTS_PER_STEP  # none lost, none trained twice


def test_a_lost_trainer_rank_and_a_stopped_slurmd(runs):
    r1, r, seen = runs
    e = r / "epoch_1"
    named = f"WorkerLostError: trainer worker rank 1 (host node2, pid {seen['rank1']}) stopped answering"
    assert named in seen["task0_b"]
    assert named.split(": ", 1)[1] in seen["out_b"]  # the rule's error paragraph names it too
    assert seen["failed_after"] < 120, f"the workflow noticed the lost rank after {seen['failed_after']:.0f}s"
    assert not seen["checkpoint_before_resume"]
    rule_log = (r / "logs" / "train_epoch_1.log").read_text()
    resumed = [int(s) for s in re.findall(r"\[resume\] epoch 1: continuing from \S+/step_(\d+)", rule_log)]
    assert resumed[0] == SAVE_EVERY and resumed[1] >= 2 * SAVE_EVERY, rule_log[-3000:]  # after (b), after (c)
    attempts = seen["attempts"]
    assert [a["state"] for a in attempts if a["id"] == seen["job_c"]] == ["NODE_FAIL", "COMPLETED"], attempts
    for f in ("model/model.safetensors",):
        assert manifest(e / "checkpoint")["files"][f]["sha256"] == \
            manifest(r1 / "epoch_1" / "checkpoint")["files"][f]["sha256"], f"{f} differs from run 1's"


def test_a_lost_trainer_rank_on_node2_is_replaced_in_the_job(runs):
    """(r): run 2's first lost rank 1 is replaced by a new step of the same job on node2, within
    the deadline; the epoch goes on, trains every group once (the same groups in the same steps as
    run 1), and ends with run 1's weights (test_a_lost_trainer_rank_and_a_stopped_slurmd)."""
    import h5py

    r1, r, seen = runs
    e, job = r / "epoch_1", seen["job_b"]
    log = seen["task0_b"]
    assert f"[recovery] on: a lost trainer rank's group is started again as a step of job {job} on ['node2']" in log
    assert f"[recovery] trainer worker rank 1 (host node2, pid {seen['rank1_first']}) stopped answering" in log
    assert "[recovery] replacing the trainer group (1/1)" in log
    done = re.search(r"\[recovery\] trainer group replaced in ([\d.]+)s; replayed (\d+) call\(s\) in ([\d.]+)s "
                     r"\(RL steps \[([\d, ]+)\], (\d+) samples\) from version 0; ([\d.]+)s lost", log)
    assert done, log[-4000:]
    restart_s, replayed = float(done.group(1)), [int(x) for x in done.group(4).split(",")]
    assert restart_s < 120 and replayed[:2] == [1, 2], done.group(0)  # trainer.recovery.restart_deadline_s
    print(f"[recovery] {done.group(0)} (kill -> replaced {seen['replaced_after']:.1f}s; a full restart: failed "
          f"{seen['failed_after']:.1f}s after its kill, the rerun's first step {seen['rerun_first_step_s']:.1f}s after "
          "it started)")
    # one recovery reported in the step metrics (steps 1-8 of the first job, kept by the rerun)
    rows = seen["metrics_b"]
    counts = [row["recovery/count_total"] for row in rows]
    assert counts[0] == 0 and counts[-1] == 1 and counts == sorted(counts), counts
    (hit,) = [row for row in rows if row["recovery/replayed_steps"] > 0]
    assert hit["recovery/replayed_steps"] == len(replayed) and hit["recovery/seconds_lost"] > 0, hit
    # the replacement step ran on node2 with one task; the lost rank was killed through a step there
    steps = {row["name"]: row for row in _sacct(job)}
    assert (steps["rl_core-trainer-ranks-1"]["nodes"], steps["rl_core-trainer-ranks-1"]["ntasks"]) == ("node2", "1")
    assert steps["rl_core-trainer-kill"]["nodes"] == "node2"
    assert "[trainer_worker] rank 1 (local rank 0) on node2" in (e / "trainer_group" / "restart1.log").read_text()
    # every group trained once: run 2's spool (steps 1-8 from the recovered job) holds run 1's groups
    with h5py.File(r1 / "epoch_1" / "rollouts.h5", "r") as f:
        g = f["groups"]
        want = sorted(zip(g["step"][:].tolist(), g["epoch"][:].tolist(), g["prompt_index"][:].tolist()))
    got = sorted((s, grp["epoch"], grp["prompt_index"]) for s in range(1, STEPS + 1)
                 for grp in json.loads((e / "rollouts.spool" / f"step_{s:06d}.json").read_text())["groups"])
    assert got == want and len(set(got)) == STEPS * PROMPTS_PER_STEP
