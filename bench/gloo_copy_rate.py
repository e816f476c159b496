"""The copy rate a weight broadcast can reach between two hosts: gloo `broadcast` of a byte
buffer from rank 0 to rank 1, the same collective the refit's buckets take (rl_core.weights.broadcast).

Run it as a 2-task Slurm step, e.g. on two namespace nodes of ci/slurm-local (SLURM_LOCAL_NODES=3):

    srun -p nodes -N 2 -n 2 --mem=2000 python bench/gloo_copy_rate.py --sizes-mb 2.3 64
    srun -p debug -N 1 -n 2 --mem=2000 python bench/gloo_copy_rate.py --sizes-mb 2.3 64   # one host

Rank 0 prints one JSON line: per size, the median seconds of `--repeats` broadcasts (after two
warm-up ones) and bytes/s, plus both hosts' names. The rendezvous is rl_core.distributed
(detect_env from the Slurm step, init_distributed). Compare the refit's `refit/sync_broadcast_s`
and `refit/bytes` of a run on the same nodes with the rate at the model's size. Figures:
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[2.3, 64.0], help="buffer sizes in MiB")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    import torch
    import torch.distributed as dist

    from rl_core.distributed import destroy_distributed, detect_env, init_distributed

    env = detect_env()
    init_distributed(env, "cpu", 120)
    name = torch.zeros(64, dtype=torch.uint8)
    raw = socket.gethostname().encode()[:64]
    name[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    names = [torch.zeros(64, dtype=torch.uint8) for _ in range(env.world_size)]
    dist.all_gather(names, name)  # each host's name, as bytes (nothing pickled)
    hosts = [bytes(n.tolist()).rstrip(b"\0").decode() for n in names]
    out = {"hosts": hosts, "sizes": []}
    for mb in args.sizes_mb:
        buf = torch.zeros(int(mb * 2**20), dtype=torch.uint8)
        times = []
        for i in range(args.repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast(buf, 0)
            dist.barrier()  # the receiver has it: the broadcast's time as the sender sees a whole bucket
            if i >= 2:
                times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        out["sizes"].append({"mib": mb, "bytes": buf.numel(), "median_s": s, "bytes_per_s": buf.numel() / s})
    if env.rank == 0:
        print(json.dumps(out), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
