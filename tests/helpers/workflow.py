"""Helpers of the workflow tier: isolated working directories, running snakemake, reading results.

Every run happens in its own working directory under pytest's tmp_path (symlinks to the
repository's recipes/, data/ and config/), so tests never touch the repository's results/
or .snakemake/ and can run beside other work in the same tree.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rl_core.report.render import PLOTS  # noqa: F401  (the report's plots, re-exported for the tests)

ROOT = Path(__file__).resolve().parents[2]
SHORT = "recipes/tiny-addition-short.yaml"
RUN = "short"


def make_workdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in ("recipes", "data", "config"):
        (path / name).symlink_to(ROOT / name)
    return path


def snakemake(workdir: Path, *args: str, timeout: float = 1800, check: bool = False,
              **popen) -> subprocess.CompletedProcess | subprocess.Popen:
    """`snakemake -s <repo>/Snakefile --directory <workdir> ARGS` (Popen when popen=True)."""
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(workdir), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **popen.pop("extra_env", {}))
    if popen.pop("popen", False):
        return subprocess.Popen(cmd, cwd=workdir, env=env, stdout=popen.pop("stdout", subprocess.PIPE),
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # timed out (or interrupted): stop snakemake and every job it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if check and out.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({out.returncode}):\n"
                             f"{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return out


def short_config(run: str = RUN, overrides: list[str] | None = None, *extra: str) -> list[str]:
    args = ["--config", f"recipe={SHORT}", f"run={run}"]
    if overrides:
        args.append("overrides=" + json.dumps(overrides))
    return [*args, *extra]


def wait_for(path: Path, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if proc is not None and proc.poll() is not None:
            return path.exists()
        time.sleep(0.02)
    return False


def manifest(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "manifest.json").read_text())


def hf_overrides(reference: Path) -> list[str]:
    """Start another run from the reference run's initial policy (imported as an HF model)."""
    return ["model.source=hf", f"model.path={reference / 'results' / RUN / 'init_policy'}"]


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of a finished workdir (results and snakemake metadata), to break without harming the original."""
    make_workdir(dst)
    shutil.copytree(src / "results", dst / "results", symlinks=True)
    shutil.copytree(src / ".snakemake" / "metadata", dst / ".snakemake" / "metadata")
    return dst


def job_stats(text: str) -> dict[str, int]:
    """{rule: count} of snakemake's "Job stats" table."""
    block = text.split("Job stats:", 1)[1].split("total", 1)[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", block, flags=re.M)}


def slurm_local(script: str, nodes: int | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ci/slurm-local/<script> (up.sh / down.sh), with SLURM_LOCAL_NODES=nodes when given."""
    env = dict(os.environ, **({"SLURM_LOCAL_NODES": str(nodes)} if nodes is not None else {}))
    return subprocess.run(["bash", str(ROOT / "ci" / "slurm-local" / script)], env=env, capture_output=True, text=True,
                          timeout=timeout)
