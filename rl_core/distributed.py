"""Rendezvous and process groups for the multi-process trainers (fsdp2, megatron).

Owns: `detect_env` (rank, world size, local rank, node and rank 0's address, read from
torchrun, a Slurm job step started by `srun` or submitit, or submitit's local executor, in
that order; otherwise one process; `expand_nodelist` reads Slurm's compressed `a[01-03,7]`,
`step_layout` a step's node and local rank per task, `SLURM_STEP_VARIABLES` a step's shape),
`init_distributed` (the default process group: gloo on CPU, NCCL on GPU with the device
bound by local rank, the recipe's collective timeout) and `check_world` (the backend
accepts this many processes, the world is a multiple of the fixed parallel sizes, a trainer
node group matches: each failure a `RecipeError` naming the field and the fix).

Does not own: what each rank runs (`rl_core.train`), job submission (workflow, submitit)
or the placement fields themselves (`rl_core.config.schema`).
Read more: docs/distributed-training.md, "How the processes work together".
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

from rl_core.errors import RecipeError

PORT_BASE, PORT_SPAN = 20000, 20000


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the trainer group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm" | "submitit-local" | "single"
    num_nodes: int = 1

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list (`gpu[01-03,7],login-a`) as host names, in order."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        part = part.strip()
        if not part:
            continue
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            items = [literal]
            if ranges:
                items = []
                for r in ranges.split(","):
                    if "-" in r:
                        lo, hi = r.split("-", 1)
                        width = len(lo)
                        items += [f"{literal}{i:0{width}d}" for i in range(int(lo), int(hi) + 1)]
                    else:
                        items.append(literal + r)
            expanded = [e + i for e in expanded for i in items]
        hosts += expanded
    return hosts


# the variables of a Slurm job step: an `srun` started from inside one would read them as its own shape
SLURM_STEP_VARIABLES = (
    "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
    "SLURM_DISTRIBUTION", "SLURM_CPUS_PER_TASK", "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_NODE", "SLURM_MEM_PER_GPU",
    "SLURM_GPUS", "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_NODE", "SLURM_EXACT", "SLURM_OVERLAP", "SLURM_CPU_BIND",
    "SLURM_NODELIST", "SLURM_STEP_NODELIST", "SLURM_JOB_NAME", "SLURM_NTASKS_PER_SOCKET", "SLURM_NTASKS_PER_CORE",
    "SLURM_NTASKS_PER_GPU", "SLURM_OPEN_MODE", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES",
    "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEPID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
    "SLURM_GTIDS", "SLURM_HOSTFILE", "SLURM_KILL_BAD_EXIT", "CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE",
    "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def step_layout(environ: Mapping[str, str] | None = None) -> list[tuple[str, int]]:
    """The node (Slurm's name) and local rank of every task of this Slurm job step, by rank:
    `SLURM_STEP_NODELIST` with `SLURM_STEP_TASKS_PER_NODE` (`2(x3),1`), tasks in blocks of a
    node (srun's default distribution when tasks outnumber nodes, and one task a node otherwise)."""
    env = os.environ if environ is None else environ
    nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST", ""))
    counts: list[int] = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not nodes or len(counts) != len(nodes):
        raise ValueError(f"not inside a Slurm job step (SLURM_STEP_NODELIST={env.get('SLURM_STEP_NODELIST')!r}, "
                         f"SLURM_STEP_TASKS_PER_NODE={env.get('SLURM_STEP_TASKS_PER_NODE')!r})")
    return [(node, local) for node, count in zip(nodes, counts) for local in range(count)]


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        if default is None:
            raise KeyError(key)
        return default
    m = re.match(r"\d+", raw)  # SLURM_STEP_TASKS_PER_NODE looks like "2(x3)"
    if not m:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer")
    return int(m.group(0))


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """This process's rank and rendezvous address from torchrun, a Slurm step, or neither."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        return DistEnv(rank=_int(env, "RANK"), world_size=world, local_rank=_int(env, "LOCAL_RANK", 0),
                       local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
                       master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_int(env, "MASTER_PORT", 29500),
                       source="torchrun", num_nodes=max(1, world // max(1, _int(env, "LOCAL_WORLD_SIZE", world))))
    if "SUBMITIT_LOCAL_NTASKS" in env and "SUBMITIT_LOCAL_GLOBALID" in env:  # submitit's local executor
        world = _int(env, "SUBMITIT_LOCAL_NTASKS")
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else \
            PORT_BASE + (_int(env, "SUBMITIT_LOCAL_JOB_ID", 0) * 131) % PORT_SPAN
        return DistEnv(rank=_int(env, "SUBMITIT_LOCAL_GLOBALID"), world_size=world,
                       local_rank=_int(env, "SUBMITIT_LOCAL_LOCALID", 0), local_world_size=world,
                       master_addr="127.0.0.1", master_port=port, source="submitit-local")
    if "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env:
        world = _int(env, "SLURM_STEP_NUM_TASKS")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or socket.gethostname()
        hosts = expand_nodelist(nodelist)
        num_nodes = _int(env, "SLURM_STEP_NUM_NODES", len(hosts) or 1)
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        else:  # the same number on every task of this step, different for the next step
            key = _int(env, "SLURM_JOB_ID", 0) * 131 + _int(env, "SLURM_STEP_ID", 0)
            port = PORT_BASE + key % PORT_SPAN
        local_world = _int(env, "SLURM_STEP_TASKS_PER_NODE", max(1, world // num_nodes))
        return DistEnv(rank=_int(env, "SLURM_PROCID"), world_size=world, local_rank=_int(env, "SLURM_LOCALID", 0),
                       local_world_size=local_world, master_addr=env.get("MASTER_ADDR", hosts[0] if hosts else "127.0.0.1"),
                       master_port=port, source="slurm", num_nodes=num_nodes)
    return DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                   master_port=_int(env, "MASTER_PORT", 29500), source="single")


def init_distributed(env: DistEnv, device: str, timeout_s: float, store=None) -> str:
    """Initialise the default process group (once); returns the torch device string of this rank.
    `store`: a rendezvous store already met (a replacement trainer group), instead of the env's address."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(env.local_rank)
        dev = f"cuda:{env.local_rank}"
    else:
        dev = "cpu"
    if dist.is_initialized():
        return dev
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs = {}
    if device == "cuda":
        kwargs["device_id"] = torch.device(dev)
    if store is not None:
        kwargs["store"] = store
    elif env.world_size == 1:  # nothing to meet: an in-memory store, no port
        kwargs["store"] = dist.HashStore()
    else:
        kwargs["init_method"] = f"tcp://{env.master_addr}:{env.master_port}"
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    return dev


def check_world(cfg, env: DistEnv, device: str, num_visible_gpus: int | None = None) -> None:
    """Placement checks of the recipe against this launch, before any model is built."""
    tcfg = cfg.trainer
    how = {"torchrun": "torchrun", "slurm": "the Slurm job step", "submitit-local": "submitit's local executor",
           "single": "this single process"}[env.source]
    if tcfg.backend == "torch" and env.world_size > 1:
        raise RecipeError.single(
            "trainer.backend", "torch", f"a multi-process backend: {how} started {env.world_size} processes",
            "set trainer.backend: fsdp2 (or megatron), or launch one task (srun -n 1 / no torchrun).")
    fixed = tcfg.parallel_product()
    if fixed is not None and env.world_size % fixed[0]:
        raise RecipeError.single(
            fixed[1].split(" x ")[0], fixed[0],
            f"a divisor of the trainer world size ({env.world_size} processes from {how}); {fixed[1]} = {fixed[0]}",
            f"launch a multiple of {fixed[0]} processes or lower {fixed[1]}.")
    group = trainer_node_group(cfg)
    if group is not None:
        want = group_world_size(group)
        if env.world_size != want:
            raise RecipeError.single(
                "cluster.trainer", {"num_nodes": group.num_nodes, "num_gpus_per_node": group.num_gpus_per_node},
                f"{want} trainer processes, as {how} launched {env.world_size}",
                "launch the trainer with the node group's size (the controller job does), or fix cluster.trainer.")
    if device == "cuda":
        if num_visible_gpus is None:
            import torch

            num_visible_gpus = torch.cuda.device_count()
        if env.local_rank >= num_visible_gpus:
            raise RecipeError.single(
                "cluster.trainer.num_gpus_per_node", getattr(group, "num_gpus_per_node", None),
                f"a GPU for every process of a node: local rank {env.local_rank} but only {num_visible_gpus} "
                f"visible GPU(s) on {socket.gethostname()}",
                "launch one task per GPU (srun --gpus-per-task=1 / --ntasks-per-node = GPUs per node).")


def trainer_node_group(cfg):
    """The recipe's trainer node group, or None when the recipe has no cluster section for it."""
    cluster = getattr(cfg, "cluster", None)
    return getattr(cluster, "trainer", None) if cluster is not None else None


def group_world_size(group) -> int:
    """Processes of a node group: nodes x processes per node (one per GPU; 1 per node on CPU unless set)."""
    per_node = getattr(group, "num_processes_per_node", None) or max(1, group.num_gpus_per_node)
    return group.num_nodes * per_node


def destroy_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
