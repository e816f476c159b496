"""A replacement worker rank of the trainer group: `python -m rl_core.launch.trainer_worker CONFIG ...`.

Owns: one worker process that `rl_core.launch.trainer_group.TrainerGroup` starts when it
replaces a lost group (a plain process with `--rank`, or a task of a Slurm job step with
`--rank-offset`: rank = offset + SLURM_PROCID): it reads the resolved recipe, meets rank 0 at its
new rendezvous store (posting its pid under the join key first, so rank 0 knows it arrived), forms
the process group and follows rank 0's commands until the run shuts the group down
(`rl_core.train.serve_as_worker`).
If rank 0 goes away its store does too, and the worker exits.

Does not own: the first launch of the ranks (torchrun, submitit, srun: `rl_core.distributed`).
"""

from __future__ import annotations

import argparse
import os
import socket
from datetime import timedelta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rl_core.launch.trainer_worker")
    ap.add_argument("config", help="the run's resolved_config.json")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--rank", type=int)
    which.add_argument("--rank-offset", type=int, help="a task of a Slurm job step: rank = this + SLURM_PROCID")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--local-rank", type=int, default=None, help="the device index on this node (default: rank)")
    ap.add_argument("--local-ranks", default=None, help="with --rank-offset: the device index of each task, by "
                    "SLURM_PROCID (comma-separated)")
    ap.add_argument("--master-addr", required=True)
    ap.add_argument("--master-port", type=int, required=True)
    args = ap.parse_args(argv)
    rank, local = task_rank(args.rank, args.rank_offset, args.local_rank, args.local_ranks)
    print(f"[trainer_worker] rank {rank} (local rank {local}) on {socket.gethostname()} pid {os.getpid()}: "
          f"joining rank 0 at {args.master_addr}:{args.master_port}", flush=True)

    import torch.distributed as dist

    from rl_core.config import load_resolved
    from rl_core.distributed import DistEnv, init_distributed
    from rl_core.launch.train import setup_process
    from rl_core.launch.trainer_group import JOIN_KEY
    from rl_core.train import serve_as_worker, trainer_device

    cfg = load_resolved(args.config)
    setup_process(cfg)
    device = trainer_device(cfg)
    timeout = timedelta(seconds=cfg.trainer.collective_timeout_s)
    store = dist.TCPStore(args.master_addr, args.master_port, args.world_size, is_master=False, timeout=timeout)
    store.set(f"{JOIN_KEY}{rank}", str(os.getpid()))
    env = DistEnv(rank=rank, world_size=args.world_size, local_rank=local, local_world_size=args.world_size,
                  master_addr=args.master_addr, master_port=args.master_port, source="single")
    init_distributed(env, device, cfg.trainer.collective_timeout_s, store=store)
    serve_as_worker(cfg)
    return 0


def task_rank(rank: int | None, offset: int | None, local_rank: int | None, local_ranks: str | None,
              environ=None) -> tuple[int, int]:
    """(rank, local rank) of this worker: `rank` as given, or `offset` + SLURM_PROCID of its job step
    task, whose local rank is that task's entry of `local_ranks`."""
    if rank is None:
        env = os.environ if environ is None else environ
        task = int(env["SLURM_PROCID"])
        rank = offset + task
        if local_rank is None and local_ranks:
            local_rank = int(local_ranks.split(",")[task])
    return rank, rank if local_rank is None else local_rank


if __name__ == "__main__":
    raise SystemExit(main())
