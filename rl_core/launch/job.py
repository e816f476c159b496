"""The controller as a submitit job, and the executors the workflow's jobs run on.

Owns: `TrainEpochJob` (the checkpointable callable that trains one epoch; on SIGUSR2, Slurm
preemption or the time limit, submitit calls `checkpoint()`, which resubmits it, and the
next attempt resumes from the newest complete step checkpoint); the one-controller-per-epoch
lock (an `flock` on `<epoch_dir>/.controller.lock`, released by the kernel even on SIGKILL,
its text naming pid and host); `make_executor` (`LocalExecutor` or `SlurmExecutor`, chosen by
the workflow's `launcher`, never submitit's AutoExecutor, with a `cluster.*` section's
resources); `wait_for_jobs` (their output copied into the rule's log, cancelled if the waiter
is stopped, a failure as one `JobError` paragraph); `submit_train_epoch` (all of it for the
`train_epoch` rule; on Slurm it re-attaches to a queued or running job of the same epoch).

Does not own: what an epoch computes or how it resumes (`stages.train_epoch`), or the
evaluation job array (`evaluate.py`). Read more: docs/workflow.md, "Recovery".
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import submitit

from rl_core.config import load_resolved
from rl_core.config.schema import ClusterConfig, SlurmJobConfig
from rl_core.errors import UserError

LAUNCHERS = ("local", "slurm")
LOCK_NAME = ".controller.lock"
JOB_RECORD = "job.json"
_ALIVE_SLURM_STATES = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING",
                       "COMPLETING", "RESIZING", "SUSPENDED"}


class JobError(UserError):
    """A submitit job of the workflow failed, died or could not be submitted."""


# --------------------------------------------------------------------------- the controller job


@contextlib.contextmanager
def controller_lock(epoch_dir: str | os.PathLike) -> Iterator[Path]:
    """Hold `<epoch_dir>/.controller.lock` for the life of this process's controller."""
    path = Path(epoch_dir) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = Path(path).read_text().strip() or "another process"
            raise JobError(f"Epoch directory {epoch_dir} is in use by another controller ({holder}); two "
                           f"controllers must never write one epoch. Fix: wait for it to finish, or stop it "
                           f"(kill that pid / scancel that job) and rerun the same command to resume.") from None
        os.ftruncate(fd, 0)
        job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID") or "-"
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "job_id": job_id}).encode())
        os.fsync(fd)
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def read_lock(epoch_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The pid/host/job id written by the controller that holds (or last held) the epoch's lock."""
    try:
        return json.loads((Path(epoch_dir) / LOCK_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def use_allocated_cpus() -> None:
    """Inside a Slurm job, size torch's thread pools to the job's CPUs (before torch is imported):
    the submitting rule's OMP_NUM_THREADS (snakemake sets it to the rule's threads) is inherited
    through sbatch and would otherwise win."""
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    if cpus and "torch" not in sys.modules:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = cpus


def stop_on_sigterm_locally() -> bool:
    """In a local submitit job, make SIGTERM (a plain `kill <pid>`) stop the process at once, as
    SIGKILL would (step checkpoints are atomic; the epoch lock is released by the kernel).
    submitit's own handler only logs "Bypassing signal SIGTERM", which is right on Slurm (there
    SIGTERM follows the requeue that SIGUSR2 started) and left a local controller running.
    True when installed (not under Slurm)."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "local":
        return False

    def stop(signum, _frame):
        sys.stdout.write(f"[job] {signal.Signals(signum).name}: stopping now; rerun the same command to resume "
                         "from the newest complete step checkpoint\n")
        sys.stdout.flush()
        signal.signal(signum, signal.SIG_DFL)  # the default action (terminate), delivered again
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, stop)
    return True


class TrainEpochJob(submitit.helpers.Checkpointable):
    """`TrainEpochJob()(resolved_config_path, epoch, prev_checkpoint, epoch_dir)` trains one epoch."""

    def __call__(self, resolved_config_path: str, epoch: int, prev_checkpoint: str, epoch_dir: str) -> dict:
        use_allocated_cpus()
        stop_on_sigterm_locally()
        from rl_core.launch import stages

        print(f"[job] {socket.gethostname()} pid {os.getpid()}: epoch {epoch} of {resolved_config_path} "
              f"from {prev_checkpoint} into {epoch_dir}", flush=True)
        from rl_core.distributed import detect_env

        if detect_env().rank != 0:  # a worker rank of a multi-process trainer: rank 0 holds the lock
            return stages.train_epoch(resolved_config_path, epoch, prev_checkpoint, epoch_dir)
        with controller_lock(epoch_dir):
            return stages.train_epoch(resolved_config_path, epoch, prev_checkpoint, epoch_dir)

    def checkpoint(self, resolved_config_path: str, epoch: int, prev_checkpoint: str,
                   epoch_dir: str) -> submitit.helpers.DelayedSubmission:
        # The state worth keeping is on disk (step checkpoints); the callable itself holds none.
        print(f"[job] preempted or out of time: requeueing epoch {epoch}; the next attempt resumes from the "
              f"newest complete step checkpoint in {Path(epoch_dir) / 'steps'}", flush=True)
        return submitit.helpers.DelayedSubmission(TrainEpochJob(), resolved_config_path, epoch, prev_checkpoint,
                                                  epoch_dir)


# --------------------------------------------------------------------------- executors


def _local_gpus() -> tuple[int, ...]:
    """GPU ids this process may use, so a local job sees the same ones (submitit sets CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return tuple(int(x) for x in visible.split(",") if x.strip().isdigit())
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(range(sum(1 for line in out.splitlines() if line.startswith("GPU "))))


def slurm_parameters(res: SlurmJobConfig, cluster: ClusterConfig, name: str, recovery: bool = False) -> dict[str, Any]:
    """submitit SlurmExecutor parameters (sbatch options) of one `cluster.*` section. `recovery`: the
    controller's trainer group is replaced in the job when a rank is lost (`trainer.recovery`), so
    its step must outlive a killed task: `--kill-on-bad-exit=0 --wait=0`, whatever the cluster's
    KillOnBadExit and WaitTime say."""
    params: dict[str, Any] = {
        "job_name": name, "time": res.timeout_min, "nodes": res.nodes, "ntasks_per_node": res.tasks_per_node,
        "cpus_per_task": res.cpus_per_task, "mem": f"{max(1, round(res.mem_gb * 1024))}M",
        "signal_delay_s": res.signal_delay_s, "array_parallelism": cluster.max_parallel_array_tasks,
        "stderr_to_stdout": True,  # one log file per job, lines in the order they were written
    }
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(res, key):
            params[key] = getattr(res, key)
    if res.gpus_per_node:
        params["gpus_per_node"] = res.gpus_per_node
    if res is cluster.controller and cluster.generation is not None:
        # one allocation for the trainer's nodes and the generation nodes after them; submitit's
        # step (its srun, whose tasks it counts) runs the trainer group on the first ones only, and
        # the controller starts the generation servers as steps on the rest (docs/cluster.md)
        trainer = cluster.trainer
        nodes = trainer.num_nodes if trainer is not None else 1
        tasks = trainer.world_size if trainer is not None else res.tasks_per_node
        params.update(nodes=nodes, ntasks_per_node=tasks // nodes,
                      srun_args=[f"--nodes={nodes}", f"--ntasks={tasks}", f"--ntasks-per-node={tasks // nodes}"])
        params["additional_parameters"] = {"nodes": res.nodes, "ntasks_per_node": res.tasks_per_node}
    if recovery and res is cluster.controller and params["nodes"] * params["ntasks_per_node"] > 1:
        params["srun_args"] = [*params.get("srun_args", []), "--kill-on-bad-exit=0", "--wait=0"]
    if res.extra_sbatch:
        params["additional_parameters"] = {**params.get("additional_parameters", {}), **res.extra_sbatch}
    return params


def make_executor(launcher: str, folder: str | os.PathLike, res: SlurmJobConfig, cluster: ClusterConfig,
                  name: str, recovery: bool = False) -> submitit.Executor:
    """A submitit executor for `launcher` ('local' or 'slurm') with the resources `res` (`recovery`:
    see `slurm_parameters`)."""
    if launcher == "local":
        gpus = _local_gpus()
        section = f"cluster.{'controller' if res is cluster.controller else 'evaluation'}"
        if res.nodes > 1:
            raise JobError(f"{section}.nodes is {res.nodes} but the local launcher runs on this machine only. Fix: "
                           f"run with --profile profiles/slurm, or set {section}.nodes: 1.")
        if res.gpus_per_node > len(gpus):
            raise JobError(f"{section}.gpus_per_node is {res.gpus_per_node} but this machine has {len(gpus)} usable "
                           f"GPU(s) (CUDA_VISIBLE_DEVICES / nvidia-smi). Fix: lower {section}.gpus_per_node or run "
                           f"with --profile profiles/slurm.")
        ex = submitit.LocalExecutor(folder, max_num_timeout=cluster.max_num_timeout)
        ex.update_parameters(timeout_min=res.timeout_min, signal_delay_s=res.signal_delay_s,
                             gpus_per_node=len(gpus), visible_gpus=gpus, name=name, stderr_to_stdout=True,
                             tasks_per_node=res.tasks_per_node)  # >1: a multi-process trainer (rl_core.train)
        return ex
    if launcher == "slurm":
        try:
            ex = submitit.SlurmExecutor(folder, max_num_timeout=cluster.max_num_timeout)
        except RuntimeError as exc:  # no srun on this machine
            raise JobError(f"launcher 'slurm' needs Slurm's commands on this machine ({exc}). Fix: run on a Slurm "
                           f"login node, or use the local launcher (snakemake --cores N, without "
                           f"--profile profiles/slurm).") from None
        ex.update_parameters(**slurm_parameters(res, cluster, name, recovery))
        return ex
    raise JobError(f"Unknown launcher {launcher!r}; expected one of {LAUNCHERS}. Fix: set `launcher` in "
                   f"config/config.yaml (or --config launcher=...) to 'local' or 'slurm'.")


# --------------------------------------------------------------------------- waiting


class _LogTail:
    """Copies what a job appends to its log (stderr goes to stdout, see make_executor) into our stdout."""

    PROGRESS_EVERY_S = 20.0  # also show the newest "[train] step" line on the terminal this often

    def __init__(self, job: submitit.Job, prefix: str = ""):
        self.job = job
        self.prefix = prefix
        self.offsets: dict[Path, int] = {}
        self.last_progress = time.monotonic()

    def pump(self) -> None:
        for path in (self.job.paths.stdout,):
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.offsets.get(path, 0))
                    data = fh.read()
                    self.offsets[path] = fh.tell()
            except OSError:
                continue
            if data:
                text = data.decode("utf-8", "replace")
                self._progress(text)
                if self.prefix:
                    text = "".join(self.prefix + line for line in text.splitlines(keepends=True))
                sys.stdout.write(text)
        sys.stdout.flush()


    def _progress(self, text: str) -> None:
        """Long stages stay visible: the newest step line every PROGRESS_EVERY_S, and every
        validation line, go to snakemake's terminal too (rl_core.launch.workflow.tell_terminal)."""
        from rl_core.launch.workflow import tell_terminal

        lines = text.splitlines()
        for line in lines:
            if line.startswith("[val]"):
                tell_terminal(f"{self.prefix}{line}")
        steps = [line for line in lines if line.startswith("[train] step")]
        if steps and time.monotonic() - self.last_progress >= self.PROGRESS_EVERY_S:
            self.last_progress = time.monotonic()
            tell_terminal(f"{self.prefix}{steps[-1]}")


def _failure(job: submitit.Job, what: str) -> JobError:
    # a multi-process trainer's driver (task 0) names what failed; a worker killed outright
    # writes no result file, and submitit waits 15 s for each missing one
    first = job.task(0) if job.num_tasks > 1 and job.task(0).paths.result_pickle.exists() else job
    try:
        exc = first.exception()
    except submitit.core.utils.UncompletedJobError as unc:
        exc = unc
    text = str(exc) if exc is not None else "no result"
    # A user error inside the job (bad checkpoint, bad recipe...) is shown as its own paragraph.
    user = re.findall(r"^rl_core\.errors\.\w+Error: (.+)$", text, flags=re.M)
    if user:
        return JobError(f"{what} (job {job.job_id}) failed: {user[-1]}")
    if isinstance(exc, submitit.core.utils.FailedJobError):
        trace = text.split("-" * 22)[1] if text.count("-" * 22) >= 2 else text  # submitit frames the traceback
        last = [line.strip() for line in trace.splitlines() if line.strip()]
        return JobError(f"{what} (job {job.job_id}) failed: {last[-1] if last else text}. Its log: "
                        f"{job.paths.stdout}. Fix: read the log above; rerunning the same "
                        f"command resumes from the newest step checkpoint.")
    return _no_result(job, what)


def _no_result(job: submitit.Job, what: str) -> JobError:
    return JobError(f"{what} (job {job.job_id}) ended without a result (state {job.state}: killed, cancelled "
                    f"or out of memory). Its log: {job.paths.stdout}. Fix: rerun the same command; it resumes "
                    f"from the newest complete step checkpoint.")


def _local_job_left_no_result(job: submitit.Job) -> bool:
    """A finished local job whose task processes left no result file: they have exited, and each
    writes its result (or its exception) before it exits, so none will appear. submitit waits
    15 s for the file anyway (for a cluster's slow shared file system) in `results()` and again
    in `exception()`; a killed local job is reported at once instead."""
    if not isinstance(job, submitit.LocalJob):
        return False
    return any(not submitit.core.utils.JobPaths(job.paths.folder, job_id=job.job_id, task_id=k).result_pickle.exists()
               for k in range(job.num_tasks))


def _done(job: submitit.Job) -> bool:
    """Whether the job has ended. submitit asks Slurm about a task without a result file at
    most once a minute; once task 0 (the driver of a multi-process trainer) has its result,
    the others are asked now: a worker killed outright writes none, and the job ends within
    seconds of its driver."""
    if isinstance(job, submitit.SlurmJob) and job.num_tasks > 1 and job.task(0).done():
        done = all(job.task(k).done(force_check=True) for k in range(1, job.num_tasks))
    else:
        done = job.done()
    return done and not _requeued(job)


_ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
           "RESIZING", "SUSPENDED"}


def _requeued(job: submitit.Job) -> bool:
    """A Slurm job seen ended (NODE_FAIL, PREEMPTED) that Slurm queued again (`JobRequeue=1`):
    slurmctld lists it as active while accounting, which submitit reads, may still show the
    ended attempt for a moment. The rule then keeps waiting for the same job id (docs/cluster.md)."""
    if not isinstance(job, submitit.SlurmJob) or job.state not in ("NODE_FAIL", "PREEMPTED", "REQUEUED"):
        return False
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job.job_id), "-o", "%T"], capture_output=True, text=True,
                             timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return bool(set(out.split()) & _ACTIVE)


def wait_for_jobs(jobs: Sequence[submitit.Job], what: str, poll_interval_s: float = 2.0,
                  prefixes: Sequence[str] | None = None) -> list[Any]:
    """Wait for every job, copying their logs to stdout; return results or raise JobError."""
    tails = [_LogTail(j, (prefixes[i] if prefixes else "")) for i, j in enumerate(jobs)]

    def stop(signum, _frame):
        for j in jobs:
            with contextlib.suppress(Exception):
                j.cancel(check=False)
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        pending = list(range(len(jobs)))
        while pending:
            for t in tails:
                t.pump()
            pending = [i for i in pending if not _done(jobs[i])]
            if pending:
                time.sleep(poll_interval_s)
        for t in tails:
            t.pump()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    results = []
    for j in jobs:
        # task 0's: a multi-process trainer's rank 0 holds the summary; a worker it replaced in the job
        # (trainer.recovery) was killed and wrote none, which does not fail the job
        first = j.task(0) if j.num_tasks > 1 else j
        if _local_job_left_no_result(first):  # without submitit's 15 s wait for the file, twice (results, exception)
            raise _no_result(j, what)
        try:
            results.append(first.results()[0])
        except Exception:  # noqa: BLE001 - turned into one paragraph that names the job and its log
            raise _failure(j, what) from None
    return results


# --------------------------------------------------------------------------- the train_epoch stage


def _reattach(launcher: str, folder: Path) -> submitit.Job | None:
    """A Slurm job of this epoch that is still queued or running (e.g. the workflow was restarted)."""
    record = folder / JOB_RECORD
    if launcher != "slurm" or not record.is_file():
        return None
    job_id = json.loads(record.read_text()).get("job_id")
    if not job_id:
        return None
    job = submitit.SlurmJob(folder=folder, job_id=str(job_id))
    return job if job.state.split(" ")[0] in _ALIVE_SLURM_STATES else None


def submit_train_epoch(resolved_config_path: str, epoch: int, prev_checkpoint: str, epoch_dir: str,
                       launcher: str = "local") -> dict:
    """Run `TrainEpochJob` as a submitit job (local process or Slurm) and wait for its summary."""
    cfg = load_resolved(resolved_config_path)
    folder = Path(epoch_dir) / "submitit"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"rl_core-train-{cfg.run_name}-e{epoch}"
    job = _reattach(launcher, folder)
    if job is not None:
        print(f"[submit] re-attaching to Slurm job {job.job_id} ({job.state}) of epoch {epoch}", flush=True)
    else:
        recovery = cfg.trainer.backend != "torch" and cfg.trainer.recovery.max_restarts > 0
        executor = make_executor(launcher, folder, cfg.cluster.controller, cfg.cluster, name, recovery)
        job = executor.submit(TrainEpochJob(), str(resolved_config_path), int(epoch), str(prev_checkpoint),
                              str(epoch_dir))
        (folder / JOB_RECORD).write_text(json.dumps({"job_id": job.job_id, "launcher": launcher, "name": name}))
        print(f"[submit] epoch {epoch}: {launcher} job {job.job_id} ({name}); logs in {folder}", flush=True)
    (summary,) = wait_for_jobs([job], f"Training epoch {epoch}", cfg.cluster.poll_interval_s)
    return summary
