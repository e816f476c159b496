"""Fixtures of the workflow tier: the short recipe's reference run (built once per session),
a real local Slurm cluster (ci/slurm-local, vendored from ../shared/slurm-local) and the same
cluster with three nodes simulated as network namespaces (docs/cluster.md)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.workflow import ROOT, make_workdir, short_config, slurm_local, snakemake


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """`snakemake --cores 2` of the short recipe, end to end (warm-up included): its workdir.

    For iterating on one test locally, RL_CORE_TEST_REFERENCE_RUN=<workdir of a finished
    reference run> reuses it."""
    reuse = os.environ.get("RL_CORE_TEST_REFERENCE_RUN")
    if reuse:
        snakemake(Path(reuse), "-n", "--cores", "2", *short_config(), check=True)
        return Path(reuse)
    wd = make_workdir(tmp_path_factory.mktemp("reference"))
    t0 = time.monotonic()
    snakemake(wd, "--cores", "2", *short_config(), check=True)
    print(f"[reference run] {time.monotonic() - t0:.0f}s")
    return wd


def _slurm_up() -> bool:
    try:
        return "UP" in subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real one-node Slurm cluster (ci/slurm-local/up.sh); torn down only if this fixture started it."""
    if os.geteuid() != 0:
        reason = "the local Slurm cluster needs root (ci/slurm-local/up.sh installs packages and starts daemons)"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    started = not _slurm_up()
    up = subprocess.run(["bash", str(ROOT / "ci" / "slurm-local" / "up.sh")], capture_output=True, text=True,
                        timeout=600)
    assert up.returncode == 0, f"ci/slurm-local/up.sh failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}"
    yield
    if started:
        subprocess.run(["bash", str(ROOT / "ci" / "slurm-local" / "down.sh")], capture_output=True, timeout=300)


def _namespace_nodes() -> int:
    """Namespace nodes of the running local cluster (ci/slurm-local/nodes.sh records them)."""
    state = Path(os.environ.get("SLURM_LOCAL_DIR", "/var/lib/slurm-local")) / "run" / "nodes"
    try:
        return int(state.read_text())
    except (OSError, ValueError):
        return 0


@pytest.fixture(scope="session")
def multinode_cluster():
    """The local cluster with 3 namespace nodes (partition `nodes`); afterwards it is brought back
    to what it was: down if this fixture started it, else to its former number of nodes."""
    if os.geteuid() != 0:
        reason = "the multi-node local Slurm cluster needs root (network namespaces, daemons; ci/slurm-local/up.sh)"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    before = _namespace_nodes() if _slurm_up() else None
    t0 = time.monotonic()
    up = slurm_local("up.sh", 3)
    assert up.returncode == 0, f"ci/slurm-local/up.sh (3 nodes) failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}"
    print(f"[multinode cluster] up in {time.monotonic() - t0:.1f}s")
    try:
        yield 3
    finally:
        if before is None:
            slurm_local("down.sh")
        elif before != 3:
            slurm_local("up.sh", before)
