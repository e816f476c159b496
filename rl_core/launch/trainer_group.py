"""Replacing the trainer group inside the running job: rank 0's side of `trainer.recovery`.

Owns: `TrainerGroup.restart`: tear the failed group down (its workers on this host killed,
rank 0's trainer dropped, the process group left), start ranks 1..N-1 again as processes
(`python -m rl_core.launch.trainer_worker`: the same world size, the recipe's placement
unchanged), meet them on a fresh rendezvous port (a new TCP store on rank 0, port chosen by
the OS), form the process group and build rank 0's trainer at the base: the newest step
checkpoint (weights, optimizer, version) or the directory the run started from. `wrap` hands
the controller a `RecoveringTrainer` over it, on one host; a group across nodes (a multi-node
Slurm step) is not wrapped yet: replacing its ranks needs a new `srun` step (docs/cluster.md).

Does not own: the journal, its replay and the budget (`rl_core.train.recovery`), the first
launch of the ranks (torchrun, submitit, srun). Read more: docs/cluster.md, "Failures".
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from rl_core.train.recovery import RecoveringTrainer
from rl_core.train.spmd import FAULT_ENV

JOIN_KEY = "rl_core/recovery/joined/"  # a replacement worker's pid, set on the new store before the group forms
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", FAULT_ENV)


class TrainerGroup:
    """Rank 0's handle on the trainer's worker ranks, for replacing them (see the module doc).

    `build(base)`: rank 0's trainer at `base` on the current process group (it publishes the
    constructor to the workers); `config_path`: the resolved recipe the workers read."""

    def __init__(self, cfg, *, world_size: int, device: str, config_path: str | Path,
                 build: Callable[[Path], Any], log_dir: str | Path):
        self.cfg, self.world_size, self.device = cfg, world_size, device
        self.config_path, self.build = Path(config_path), build
        self.log_dir = Path(log_dir)
        self.procs: list[subprocess.Popen] = []
        self.restarts = 0

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

    @staticmethod
    def arm(trainer: Any) -> None:
        """A lost worker of this host is killed by the channel's watchdog, not rank 0 (`CommandChannel.recoverable`)."""
        channel = getattr(trainer, "channel", None)
        if channel is not None:
            channel.recoverable = True

    def _teardown(self, old: Any) -> None:
        from rl_core.distributed import destroy_distributed

        channel = getattr(old, "channel", None)
        far: list[int] = []
        if channel is not None and channel.world_size > 1:
            far = channel.kill_workers(list(range(1, channel.world_size)))
            channel.abandon()
        for p in self.procs:  # workers this process started at an earlier replacement
            if p.poll() is None:
                p.kill()
            p.wait()
        self.procs = []
        old = channel = None
        destroy_distributed()
        gc.collect()
        if far:
            raise RuntimeError(f"trainer worker rank(s) {far} run on other hosts; replacing them needs the Slurm "
                               "launcher's recovery (a new srun step), which rl_core does not have yet")

    def _spawn(self, port: int) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for rank in range(1, self.world_size):
            log = open(self.log_dir / f"rank{rank}.restart{self.restarts}.log", "ab")  # noqa: SIM115 - the child's
            cmd = [sys.executable, "-m", "rl_core.launch.trainer_worker", str(self.config_path), "--rank", str(rank),
                   "--world-size", str(self.world_size), "--master-addr", socket.gethostname(), "--master-port",
                   str(port)]
            with log:
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL))

    def _await_join(self, store, deadline: float) -> None:
        """Every new worker set its join key, before `deadline`; a worker that exits first fails the restart."""
        waiting = set(range(1, self.world_size))
        while waiting:
            waiting = {r for r in waiting if not store.check([f"{JOIN_KEY}{r}"])}
            for rank, p in zip(range(1, self.world_size), self.procs):
                if p.poll() is not None:
                    raise RuntimeError(f"the replacement trainer worker rank {rank} exited with {p.returncode} before "
                                       f"joining the group; its log: {self.log_dir / f'rank{rank}.restart{self.restarts}.log'}")
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"replacement trainer worker rank(s) {sorted(waiting)} did not join before "
                                   "trainer.recovery.restart_deadline_s")
            time.sleep(0.05)

    def close(self) -> None:
        """After the run: the replacement workers have returned from serving; reap them."""
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
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
    or `trainer.recovery.max_restarts: 0`: fail fast)."""
    import torch.distributed as dist

    from rl_core.train import trainer_device

    from rl_core.config import write_resolved

    rec = cfg.trainer.recovery
    if cfg.trainer.backend == "torch" or not dist.is_initialized() or dist.get_world_size() == 1 \
            or rec.max_restarts == 0:
        return trainer
    from rl_core.distributed import detect_env

    if detect_env().num_nodes > 1:  # replacing ranks on other nodes needs a new srun step: not built yet
        print("[recovery] off: the trainer group spans nodes; a lost rank ends the job as with "
              "trainer.recovery.max_restarts: 0 (rerun the same command to resume; docs/cluster.md)", flush=True)
        return trainer
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        print("[recovery] note: under torchrun a lost worker ends every rank (torchrun's agent stops the group); "
              "in-job recovery needs ranks started by Slurm, submitit or as plain processes", flush=True)
    group_dir = Path(run_dir) / "trainer_group"
    config_path = write_resolved(cfg, group_dir)
    device = trainer_device(cfg)
    group = TrainerGroup(cfg, world_size=dist.get_world_size(), device=device, config_path=config_path,
                         build=lambda at: trainer_at(cfg, at, device), log_dir=group_dir)
    group.arm(trainer)
    recovering = RecoveringTrainer(trainer, lambda at, old, deadline: group.restart(Path(at), old, deadline), base=base, base_version=base_version,
                                   max_restarts=rec.max_restarts, deadline_s=rec.restart_deadline_s)
    recovering.on_close = group.close
    return recovering

