"""The rank-0 command channel of the multi-process trainers (`rl_core.train.spmd`), on 2 real
gloo processes: commands run on every rank in order with their collectives, a worker may
wait for the next command far longer than the process group's timeout, and a worker's
failure reaches rank 0 with the rank and the traceback (then the group refuses new work)."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.trainers import free_port

PG_TIMEOUT_S = 3.0


class Target:
    def _spmd_add(self, x: float) -> float:
        t = torch.tensor([x * (dist.get_rank() + 1)])
        dist.all_reduce(t)  # a collective inside the command
        return float(t)

    def _spmd_fail_on_worker(self) -> None:
        if dist.get_rank() == 1:
            raise ValueError("worker-side problem")


def _proc(rank: int, port: int, out: str) -> None:
    from rl_core.train.spmd import CommandChannel, WorkerError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=PG_TIMEOUT_S))
    channel = CommandChannel.shared(timeout_s=60)
    assert CommandChannel.shared() is channel
    if rank == 1:
        try:
            channel.serve(lambda **kw: Target())
        except ValueError:
            return  # reported to rank 0 through the store
        return
    result = {}
    target = Target()
    seq = channel.publish("__init__", (), {})
    channel.complete(seq)
    result["add"] = channel.call(target, "add", 2.0)
    time.sleep(2 * PG_TIMEOUT_S)  # generation takes a while: the worker waits on the store, not in a collective
    result["add_after_idle"] = channel.call(target, "add", 1.0)
    try:
        channel.call(target, "fail_on_worker")
    except WorkerError as exc:
        result["error"] = str(exc)
    try:
        channel.call(target, "add", 1.0)
    except WorkerError as exc:
        result["after"] = str(exc)
    with open(out, "w") as fh:
        json.dump(result, fh)


def test_commands_idle_waits_and_worker_errors(tmp_path):
    out = tmp_path / "r.json"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_proc, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    r = json.loads(out.read_text())
    assert r["add"] == 2.0 * 1 + 2.0 * 2 and r["add_after_idle"] == 3.0
    assert "rank 1" in r["error"] and "ValueError: worker-side problem" in r["error"]
    assert "failed earlier" in r["after"]
