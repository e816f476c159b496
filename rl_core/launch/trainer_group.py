"""Replacing the trainer group inside the running job: rank 0's side of `trainer.recovery`.

Owns: `TrainerGroup.restart`: tear the failed group down (its workers killed, rank 0's trainer
dropped, the process group left), start ranks 1..N-1 again (`python -m rl_core.launch.trainer_worker`:
the same world size and placement), meet them on a fresh rendezvous port (a new TCP store on
rank 0, port chosen by the OS), form the process group and build rank 0's trainer at the base:
the newest step checkpoint (weights, optimizer, version) or the directory the run started from.
On one host the workers are plain processes; across nodes (`SlurmTrainerGroup`) they are one new
`srun --overlap` step of the controller's job laid out as the first step's ranks were, and a
worker on another node is killed by pid through a one-task step on its node. `wrap` hands the
controller a `RecoveringTrainer` over it.

Does not own: the journal, its replay and the budget (`rl_core.train.recovery`), the first
launch of the ranks (torchrun, submitit, srun). Read more: docs/cluster.md, "Failures".
"""

from __future__ import annotations

import gc
import os
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from rl_core.distributed import SLURM_STEP_VARIABLES
from rl_core.train.recovery import RecoveringTrainer
from rl_core.train.spmd import FAULT_ENV

JOIN_KEY = "rl_core/recovery/joined/"  # a replacement worker's pid, set on the new store before the group forms
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", FAULT_ENV)
KILL_STEP_S = 60.0  # how long killing the workers of one node through a job step may take


class TrainerGroup:
    """Rank 0's handle on the trainer's worker ranks, for replacing them (see the module doc).

    `build(base)`: rank 0's trainer at `base` on the current process group (it publishes the
    constructor to the workers); `group_dir`: where the workers' logs and the resolved recipe
    they read go (written at the first replacement)."""

    def __init__(self, cfg, *, world_size: int, device: str, build: Callable[[Path], Any], group_dir: str | Path):
        self.cfg, self.world_size, self.device = cfg, world_size, device
        self.build = build
        self.group_dir = Path(group_dir)
        self.procs: list[subprocess.Popen] = []
        self.restarts = 0
        self._config_path: Path | None = None

    def restart(self, base: Path, old: list, deadline: float) -> Any:
        """Tear down `old[0]` (emptied), start a new group, return rank 0's trainer at `base`."""
        self._teardown(old.pop() if old else None)
        import torch.distributed as dist

        from rl_core.distributed import DistEnv, init_distributed

        timeout = self.cfg.trainer.collective_timeout_s
        store = dist.TCPStore("0.0.0.0", 0, self.world_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout))
        self.restarts += 1
        self._spawn(store.port)
        self._await_join(store, deadline)
        env = DistEnv(rank=0, world_size=self.world_size, local_rank=0, local_world_size=self.world_size,
                      master_addr=socket.gethostname(), master_port=store.port, source="single")
        init_distributed(env, self.device, timeout, store=store)
        trainer = self.build(base)
        self.arm(trainer)
        return trainer

    def arm(self, trainer: Any) -> None:
        """A lost worker is killed by the channel's watchdog, not rank 0 (`CommandChannel.recoverable`)."""
        channel = getattr(trainer, "channel", None)
        if channel is not None:
            channel.recoverable = True
            channel.kill_far = self.kill_far

    def kill_far(self, far: dict[int, dict]) -> list[int]:
        """Kill workers on other hosts ({rank: whereabouts}); returns the ranks not reached (here: all)."""
        return sorted(far)

    def config_path(self) -> Path:
        """The resolved recipe the replacement workers read (written once, at the first replacement)."""
        if self._config_path is None:
            from rl_core.config import write_resolved

            self.group_dir.mkdir(parents=True, exist_ok=True)
            self._config_path = write_resolved(self.cfg, self.group_dir)
        return self._config_path

    def worker_command(self, port: int, *rank_args: str) -> list[str]:
        return [sys.executable, "-m", "rl_core.launch.trainer_worker", str(self.config_path()), *rank_args,
                "--world-size", str(self.world_size), "--master-addr", socket.gethostname(), "--master-port", str(port)]

    def environment(self) -> dict[str, str]:
        """This process's environment without its own launch's shape (rank, world, Slurm step, fault drill)."""
        drop = set(_LAUNCH_ENV) | set(SLURM_STEP_VARIABLES)
        return {k: v for k, v in os.environ.items() if k not in drop}

    def _teardown(self, old: Any) -> None:
        from rl_core.distributed import destroy_distributed

        channel = getattr(old, "channel", None)
        missed: list[int] = []
        if channel is not None and channel.world_size > 1:
            missed = channel.kill_workers(list(range(1, channel.world_size)))
            channel.abandon()
        self._stop_procs()
        old = channel = None
        destroy_distributed()
        gc.collect()
        if missed:
            raise RuntimeError(f"trainer worker rank(s) {missed} of the failed group could not be killed (they run "
                               "on other hosts, not reachable from rank 0 by this launcher)")

    def _stop_procs(self) -> None:
        """Workers this process started at an earlier replacement (by now killed, or to be)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.procs = []

    def log_path(self, rank: int | None = None) -> Path:
        return self.group_dir / f"rank{rank}.restart{self.restarts}.log"

    def _spawn(self, port: int) -> None:
        env = self.environment()
        self.group_dir.mkdir(parents=True, exist_ok=True)
        for rank in range(1, self.world_size):
            log = open(self.log_path(rank), "ab")  # noqa: SIM115 - the child's
            with log:
                self.procs.append(subprocess.Popen(self.worker_command(port, "--rank", str(rank)), env=env,
                                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))

    def _await_join(self, store, deadline: float) -> None:
        """Every new worker set its join key, before `deadline`; a worker that exits first fails the restart."""
        waiting = set(range(1, self.world_size))
        while waiting:
            waiting = {r for r in waiting if not store.check([f"{JOIN_KEY}{r}"])}
            for p in self.procs:
                if p.poll() is not None and waiting:
                    raise RuntimeError(f"replacement trainer worker(s) {sorted(waiting)} exited with {p.returncode} "
                                       f"before joining the group; the log: {self._log_of(p)}")
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"replacement trainer worker rank(s) {sorted(waiting)} did not join before "
                                   "trainer.recovery.restart_deadline_s")
            time.sleep(0.05)

    def _log_of(self, proc: subprocess.Popen) -> Path:
        return self.log_path(self.procs.index(proc) + 1)

    def close(self) -> None:
        """After the run: the replacement workers have returned from serving; reap them."""
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


class SlurmTrainerGroup(TrainerGroup):
    """A trainer group across nodes, started as a Slurm job step (see the module doc).

    `layout`: the first step's (node, local rank) of every rank (`rl_core.distributed.step_layout`);
    ranks 1..N-1 start again where they ran, as one `srun --jobid <job> --overlap` step (`--overlap`:
    the first step, which holds rank 0, keeps the allocation's CPUs, memory and GPUs) whose tasks are
    placed by a host file (`--distribution=arbitrary`); a task's rank is 1 + its `SLURM_PROCID`. The
    step ends as a whole when one of its tasks fails (`--kill-on-bad-exit=1`): it is replaced as one."""

    def __init__(self, cfg, *, layout: list[tuple[str, int]], job_id: str, **kwargs):
        super().__init__(cfg, **kwargs)
        self.layout, self.job_id = layout, str(job_id)

    def srun(self, *args: str) -> list[str]:
        return ["srun", f"--jobid={self.job_id}", "--overlap", *args]

    def step_command(self, port: int) -> list[str]:
        ranks = self.layout[1:]
        nodes = list(dict.fromkeys(node for node, _ in ranks))
        res = self.cfg.cluster.controller
        args = [f"--nodes={len(nodes)}", f"--ntasks={len(ranks)}", "--distribution=arbitrary",
                f"--cpus-per-task={res.cpus_per_task}", "--kill-on-bad-exit=1",
                f"--job-name=rl_core-trainer-ranks-{self.restarts}"]
        if res.gpus_per_node:
            args.append(f"--gpus-per-node={res.gpus_per_node}")
        local = ",".join(str(lr) for _, lr in ranks)
        return self.srun(*args) + self.worker_command(port, "--rank-offset", "1", "--local-ranks", local)

    def log_path(self, rank: int | None = None) -> Path:
        return self.group_dir / f"restart{self.restarts}.log"  # the step's: every task's lines, each naming its rank

    def _spawn(self, port: int) -> None:
        from rl_core.fsutil import atomic_write_text

        self.group_dir.mkdir(parents=True, exist_ok=True)
        hostfile = self.group_dir / f"restart{self.restarts}.hosts"
        atomic_write_text(hostfile, "".join(f"{node}\n" for node, _ in self.layout[1:]))
        env = {**self.environment(), "SLURM_HOSTFILE": str(hostfile)}
        with open(self.log_path(), "ab") as log:
            self.procs.append(subprocess.Popen(self.step_command(port), env=env, stdout=log,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))

    def _log_of(self, proc: subprocess.Popen) -> Path:
        return self.log_path()

    def kill_far(self, far: dict[int, dict]) -> list[int]:
        """SIGKILL workers on other nodes by pid: one one-task `srun --overlap --nodelist <node>` step
        a node, all at once; a rank without a known pid, or whose step failed, is not reached."""
        by_node: dict[str, list[int]] = {}
        missed = []
        for rank, info in far.items():
            if not info.get("pid") or not 0 < rank < len(self.layout):
                missed.append(rank)
                continue
            by_node.setdefault(info.get("node") or self.layout[rank][0], []).append(rank)
        steps = {}
        for node, ranks in by_node.items():
            pids = [str(int(far[r]["pid"])) for r in ranks]
            cmd = self.srun("--nodes=1", "--ntasks=1", f"--nodelist={node}", "--cpus-per-task=1",
                            "--job-name=rl_core-trainer-kill", "/bin/sh", "-c", 'kill -KILL "$@" 2>/dev/null; exit 0',
                            "kill", *pids)
            steps[node] = subprocess.Popen(cmd, env=self.environment(), stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        end = time.monotonic() + KILL_STEP_S
        for node, proc in steps.items():
            try:
                out, _ = proc.communicate(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            if proc.returncode != 0:
                print(f"[recovery] could not kill trainer rank(s) {by_node[node]} on {node} "
                      f"(srun exit {proc.returncode}): {out.strip()[-500:]}", flush=True)
                missed += by_node[node]
        return sorted(missed)

    def _stop_procs(self) -> None:
        """An earlier replacement's step: its tasks are killed by now, so its srun ends; SIGTERM
        (srun forwards it to the tasks) and then SIGKILL if it does not."""
        for p in self.procs:
            for stop in (None, p.terminate, p.kill):
                if stop is not None:
                    stop()
                try:
                    p.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.procs = []


def trainer_at(cfg, base: Path, device: str) -> Any:
    """Rank 0's trainer at `base`: a run checkpoint (weights, optimizer state, version), or an HF
    policy directory at weight version 0 (a run that has no checkpoint yet)."""
    from rl_core.checkpoint import load_run_checkpoint
    from rl_core.controller.train_pump import needs_reference_logprobs
    from rl_core.train import make_trainer

    keep = needs_reference_logprobs(cfg)
    if (base / "manifest.json").is_file():
        ck = load_run_checkpoint(base, restore_rng=False, verified=True)
        return make_trainer(cfg, ck.model_dir, device=device, version=int(ck.trainer_state["version"]),
                            trainer_state=ck.trainer_state, keep_reference=keep)
    return make_trainer(cfg, base, device=device, version=0, keep_reference=keep)


def wrap(cfg, trainer: Any, *, base: Path, base_version: int, run_dir: str | Path) -> Any:
    """A `RecoveringTrainer` over a multi-process `trainer` (rank 0 of a group of several) whose
    state is `base` (`trainer_at`) plus nothing trained yet, or `trainer` itself (one process,
    `trainer.recovery.max_restarts: 0`, or a launch whose ranks it cannot start again: fail fast)."""
    import torch.distributed as dist

    from rl_core.distributed import detect_env, step_layout
    from rl_core.train import trainer_device

    rec = cfg.trainer.recovery
    if cfg.trainer.backend == "torch" or not dist.is_initialized() or dist.get_world_size() == 1 \
            or rec.max_restarts == 0:
        return trainer
    env, world = detect_env(), dist.get_world_size()
    device = trainer_device(cfg)
    common = dict(world_size=world, device=device, build=lambda at: trainer_at(cfg, at, device),
                  group_dir=Path(run_dir) / "trainer_group")
    if env.num_nodes > 1:
        layout = step_layout() if env.source == "slurm" else []
        job = os.environ.get("SLURM_JOB_ID")
        if len(layout) != world or not job or shutil.which("srun") is None:
            print("[recovery] off: the trainer group spans nodes but was not started as one Slurm job step (srun, "
                  "submitit); a lost rank ends the job as with trainer.recovery.max_restarts: 0 (rerun the same "
                  "command to resume; docs/cluster.md)", flush=True)
            return trainer
        group: TrainerGroup = SlurmTrainerGroup(cfg, layout=layout, job_id=job, **common)
        print(f"[recovery] on: a lost trainer rank's group is started again as a step of job {job} on "
              f"{sorted({node for node, _ in layout[1:]})} (up to {rec.max_restarts} time(s))", flush=True)
    else:
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            print("[recovery] note: under torchrun a lost worker ends every rank (torchrun's agent stops the "
                  "group); in-job recovery needs ranks started by Slurm, submitit or as plain processes", flush=True)
        group = TrainerGroup(cfg, **common)
    group.arm(trainer)
    recovering = RecoveringTrainer(trainer, lambda at, old, deadline: group.restart(Path(at), old, deadline),
                                   base=base, base_version=base_version, max_restarts=rec.max_restarts,
                                   deadline_s=rec.restart_deadline_s)
    recovering.on_close = group.close
    return recovering
