"""`rl-core --version` and shell completion, as a user meets them: the version a real
`rl-core` process prints is the installed distribution's (importlib.metadata) and
pyproject.toml's; the bash script, sourced by a real bash, registers `complete -F` for
rl-core and completes subcommands, options, fixed choices and recipe override fields; the
zsh script registers the same function through bashcompinit (where zsh is installed)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import version

import pytest

from tests.helpers.paths import ROOT


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rl_core.launch.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_version_prints_the_installed_package_version():
    import rl_core

    done = _cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"rl-core {version('rl_core')}"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version("rl_core") == pyproject == rl_core.__version__ == rl_core.package_version()


# (words typed after `rl-core`, the word being completed last) -> candidates that must be offered / must not
CASES = [
    ([""], {"train", "serve", "completion", "--version"}, {"--resume-from"}),
    (["tr"], {"train"}, {"serve"}),
    (["docs", "--format", ""], {"text", "markdown"}, {"train"}),
    (["make-data", ""], {"addition", "arithmetic", "reasoning_gym"}, set()),
    (["make-data", "--out", "d", "ar"], {"arithmetic"}, {"addition"}),
    (["completion", ""], {"bash", "zsh"}, set()),
    (["train", "--res"], {"--resume-from"}, {"--out"}),
    (["serve", "m", "--device", ""], {"auto", "cpu", "cuda"}, set()),
    (["train", "r.yaml", "grpo.max_num_s"], {"grpo.max_num_steps="}, {"grpo.seed="}),
    (["validate", "r.yaml", "logging.tr"], {"logging.trackers="}, set()),
    (["train", "r.yaml", "--resume-from", ""], set(), {"grpo.seed="}),  # an option's value: file names
]


def test_bash_completion_registers_and_completes(tmp_path):
    script = _cli("completion", "bash")
    assert script.returncode == 0, script.stderr
    (tmp_path / "rl-core.bash").write_text(script.stdout)
    lines = [f"source {tmp_path / 'rl-core.bash'}", "complete -p rl-core"]
    for words, _, _ in CASES:
        quoted = " ".join(f"'{w}'" for w in ["rl-core", *words])
        lines += [f"COMP_WORDS=({quoted}); COMP_CWORD={len(words)}; COMPREPLY=()", "_rl_core_complete",
                  'echo "REPLY ${COMPREPLY[*]}"']
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", "\n".join(lines)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == "complete -o default -F _rl_core_complete rl-core"
    replies = [set(line.split()[1:]) for line in out[1:]]
    assert len(replies) == len(CASES)
    for (words, want, never), got in zip(CASES, replies):
        assert want <= got and not never & got, (words, got)


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_completion_registers_the_function(tmp_path):
    script = _cli("completion", "zsh")
    assert script.returncode == 0, script.stderr
    (tmp_path / "_rl-core.zsh").write_text(script.stdout)
    # zsh's own completion filters candidates by the prefix typed, so the function offers them all
    body = (f"source {tmp_path / '_rl-core.zsh'}; print -r -- \"$_comps[rl-core]\"; setopt ksharrays; "
            "COMP_WORDS=(rl-core docs --format ''); COMP_CWORD=3; _rl_core_complete; print -r -- \"${COMPREPLY[*]}\"")
    done = subprocess.run(["zsh", "-f", "-c", body], capture_output=True, text=True, timeout=60,
                          env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    registered, reply = done.stdout.splitlines()
    assert registered == "_bash_complete -o default -F _rl_core_complete"
    assert reply.split() == ["text", "markdown"]
