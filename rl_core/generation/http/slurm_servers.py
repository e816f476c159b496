"""Generation servers on the generation node group: `rl-core serve` as Slurm job steps.

Owns: `generation_nodes` (inside the controller job's trainer step, the nodes of the
allocation that the step does not use, which hold `cluster.generation`; None outside Slurm
or without that group) and `SlurmServer`: one `rl-core serve --managed` started with
`srun --jobid <job> --nodes 1 --nodelist <node> --exact ...` as a step of the controller's
own allocation, bound to every address of its node and reached by the node's name, its
token and control secret passed through the environment Slurm forwards (never on the
command line), its log and ready file on the shared file system; stopped through its
`srun` (SIGTERM is forwarded to the task; the job's end ends any step left).

Does not own: routing, health checks and restarts (fleet.py), the local processes
(servers.py), which nodes the allocation has (`rl_core.launch.job.slurm_parameters`).
Read more: docs/cluster.md.
"""

from __future__ import annotations

import os
from typing import Mapping

from rl_core.distributed import SLURM_STEP_VARIABLES, expand_nodelist
from rl_core.errors import RecipeError
from rl_core.generation.http.servers import LocalServer


def generation_nodes(cfg, environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The node names of `cluster.generation` inside the controller job, or None (no such
    group, or not inside a Slurm job step: local servers then). The controller job's
    allocation holds the trainer's nodes, where its trainer step runs, and the generation
    nodes after them (`rl_core.launch.job.slurm_parameters`)."""
    env = os.environ if environ is None else environ
    group = cfg.cluster.generation
    if group is None or not env.get("SLURM_JOB_ID") or "SLURM_STEP_NODELIST" not in env:
        return None
    job_nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST", ""))
    step_nodes = set(expand_nodelist(env["SLURM_STEP_NODELIST"]))
    free = [n for n in job_nodes if n not in step_nodes]
    if len(free) < group.num_nodes:
        trainer_nodes = cfg.cluster.trainer.num_nodes if cfg.cluster.trainer is not None else 1
        raise RecipeError.single(
            "cluster.generation.num_nodes", group.num_nodes,
            f"that many nodes of the controller job besides the trainer's: job {job_nodes}, trainer step "
            f"{sorted(step_nodes)} leave {free}",
            f"submit the controller job with cluster.controller.nodes >= {trainer_nodes + group.num_nodes} (the trainer's "
            "nodes + the generation nodes), as the workflow's Slurm launcher does (docs/cluster.md).")
    return free[-group.num_nodes:]


class SlurmServer(LocalServer):
    """One `rl-core serve` as a job step on `node` of the controller job (see the module doc)."""

    bind_host = "0.0.0.0"  # every address of its node; the token is required (checked by rl-core serve)
    remote = True

    def __init__(self, index: int, node: str, *args, job_id: str, cpus: int = 1, mem_mb: int = 0, gpus: int = 0,
                 **kwargs):
        super().__init__(index, *args, **kwargs)
        if self.engine.cuda_devices:
            raise ValueError("a Slurm server gets its GPUs from Slurm (--gpus-per-task), not engine.cuda_devices")
        self.node = node
        self.job_id = str(job_id)
        self.cpus, self.mem_mb, self.gpus = int(cpus), int(mem_mb), int(gpus)

    def command(self) -> list[str]:
        srun = ["srun", f"--jobid={self.job_id}", "--nodes=1", "--ntasks=1", f"--nodelist={self.node}", "--exact",
                f"--cpus-per-task={self.cpus}", f"--job-name=rl_core-generation-{self.index}", "--kill-on-bad-exit=1"]
        if self.mem_mb:
            srun.append(f"--mem={self.mem_mb}M")
        if self.gpus:
            srun.append(f"--gpus-per-task={self.gpus}")
        return srun + super().command()

    def environment(self) -> dict[str, str]:
        env = super().environment()  # srun forwards it to the task (--export=ALL, the default)
        for name in SLURM_STEP_VARIABLES:  # the controller's own step: not the server's shape
            env.pop(name, None)
        return env

    def url_of(self, ready: dict) -> str:
        return f"http://{self.node}:{ready['port']}"


def slurm_servers(cfg, nodes: list[str], model_dir, engine, log_dir, weight_version: int = 0,
                  environ: Mapping[str, str] | None = None) -> list[SlurmServer]:
    """The servers of `cluster.generation` on `nodes` (from `generation_nodes`): its processes
    per node each, with the controller job's CPUs per task and an equal share of its memory
    and of the group's GPUs per node."""
    from pathlib import Path

    env = os.environ if environ is None else environ
    group, job = cfg.cluster.generation, cfg.cluster.controller
    per_node = group.num_processes_per_node or max(1, group.num_gpus_per_node)
    name = Path(model_dir).resolve().name
    return [SlurmServer(i, nodes[i // per_node], model_dir, engine, "", log_dir, name, weight_version,
                        job_id=env["SLURM_JOB_ID"], cpus=job.cpus_per_task, mem_mb=int(job.mem_gb * 1024) // per_node,
                        gpus=group.num_gpus_per_node // per_node)
            for i in range(per_node * len(nodes))]
