"""A stand-in for Slurm's `srun` in unit tests (tests/unit/test_trainer_group_slurm.py): it
appends its options, command, host file and a few environment variables as one JSON line to
$FAKE_SRUN_LOG, then runs the command's tasks on this host, each with SLURM_PROCID and
SLURMD_NODENAME (the host file's line for `--distribution=arbitrary`, else `--nodelist`), and
exits with the highest exit code. SIGTERM ends the tasks (srun forwards it). Not a cluster:
the real `srun` is exercised by tests/workflow/test_multinode_slurm.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

RECORDED_ENV = ("SLURM_NTASKS", "SLURM_HOSTFILE", "RL_CORE_TRAINER_FAULT", "SLURM_JOB_ID")


def main(argv: list[str]) -> int:
    opts = []
    while argv and argv[0].startswith("-"):
        opts.append(argv.pop(0))
    values = dict(o[2:].split("=", 1) for o in opts if "=" in o)
    hostfile = os.environ.get("SLURM_HOSTFILE")
    hosts_text = open(hostfile).read() if values.get("distribution") == "arbitrary" and hostfile else None
    with open(os.environ["FAKE_SRUN_LOG"], "a") as log:
        log.write(json.dumps({"opts": opts, "cmd": argv, "hostfile": hosts_text,
                              "env": {k: os.environ.get(k) for k in RECORDED_ENV}}) + "\n")
    ntasks = int(values.get("ntasks", "1"))
    hosts = hosts_text.split() if hosts_text else [values.get("nodelist", "localhost")] * ntasks
    tasks = [subprocess.Popen(argv, env={**os.environ, "SLURM_PROCID": str(i), "SLURMD_NODENAME": hosts[i]})
             for i in range(ntasks)]

    def forward(signum, _frame):
        for t in tasks:
            if t.poll() is None:
                t.kill()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, forward)
    return max(t.wait() for t in tasks)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
