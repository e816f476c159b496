"""Placement: the supported generation backend x placement pairs, the errors at config load
for the others (naming backend and placement), and the start-up overlap machinery."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from rl_core.launch.preflight import load_recipe
from rl_core.config.placement_rules import SUPPORTED
from rl_core.errors import RecipeError
from rl_core.launch.placement import SetupRecord, build_overlapped

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-addition.yaml"


def _load(*overrides):
    return load_recipe(RECIPE, list(overrides))


@pytest.mark.parametrize("backend,placement", sorted(SUPPORTED))
def test_supported_pairs_load(backend, placement):
    extra = ["generation.http.num_local_servers=1"] if backend == "http" else []
    cfg = _load(f"generation.backend={backend}", f"generation.placement={placement}", *extra)
    assert (cfg.generation.backend, cfg.generation.placement) == (backend, placement)


def test_unsupported_pair_names_backend_and_placement():
    with pytest.raises(RecipeError) as info:
        _load("generation.backend=native", "generation.placement=separate")
    msg = str(info.value)
    assert "generation.placement" in msg and "'separate'" in msg and "generation.backend 'native'" in msg
    assert "Fix:" in msg


@pytest.mark.parametrize("overrides,field", [
    (["generation.backend=vllm", "generation.vllm.server_url=http://127.0.0.1:8000"], "generation.vllm.server_url"),
    (["generation.backend=vllm", "generation.placement=separate", "generation.vllm.server_url=localhost:8000"],
     "generation.vllm.server_url"),
    (["generation.backend=vllm", "generation.top_p=0.9"], "generation.top_p"),
    (["generation.backend=vllm", "generation.top_k=20"], "generation.top_k"),
    (["generation.backend=vllm", "generation.temperature=0.005"], "generation.temperature"),
    (["generation.backend=vllm", "validation.sampling.greedy=false", "validation.sampling.top_p=0.5"],
     "validation.sampling.top_p"),
    (["generation.backend=vllm", "generation.vllm.max_model_len=128"], "generation.vllm.max_model_len"),
    (["generation.backend=vllm", "generation.vllm.max_model_len=8"], "generation.vllm.max_model_len"),
])
def test_vllm_options_it_cannot_honour_fail_at_load(overrides, field):
    with pytest.raises(RecipeError) as info:
        _load(*overrides)
    assert f"`{field}`" in str(info.value)


def test_filters_are_fine_for_greedy_and_for_the_native_backend():
    _load("generation.backend=vllm", "generation.greedy=true", "generation.top_p=0.5")
    _load("generation.top_p=0.9", "generation.top_k=20")


def test_setup_record_metrics_and_line():
    rec = SetupRecord(label="x/y", parts={"generation": (10.0, 14.0), "trainer": (10.5, 12.0)}, start=10.0, end=14.1)
    m = rec.metrics()
    assert m["timing/setup/generation_s"] == 4.0 and m["timing/setup/trainer_s"] == 1.5
    assert m["timing/setup/overlap_s"] == 1.5 and m["timing/setup/sum_s"] == 5.5
    assert abs(m["timing/setup/total_s"] - 4.1) < 1e-9
    assert rec.line().startswith("[setup] generation 4.0s, trainer 1.5s (x/y); total 4.1s")


class _Fake:
    closed = False

    def close_sync(self):
        self.closed = True


def _cfg():
    return _load("generation.backend=native")


def test_build_overlapped_runs_both_setups_at_once(monkeypatch):
    """Each side waits for the other to have started: this only finishes if they overlap."""
    import rl_core.launch.placement as placement

    both = threading.Barrier(2, timeout=30)
    fake = _Fake()

    def generation(*a, **k):
        both.wait()
        time.sleep(0.05)
        return fake

    def trainer():
        both.wait()
        time.sleep(0.05)
        return "trainer"

    monkeypatch.setattr(placement, "make_generation_backend", generation)
    lines = []
    backend, tr, rec = build_overlapped(_cfg(), "unused", tokenizer=None, device="cpu", weight_version=0,
                                        make_trainer=trainer, echo=lines.append)
    assert backend is fake and tr == "trainer"
    assert rec.overlap_s() > 0 and rec.total_s < rec.sum_s
    assert lines and "native/colocated" in lines[0]


def test_build_overlapped_releases_generation_when_the_trainer_fails(monkeypatch):
    import rl_core.launch.placement as placement

    fake = _Fake()
    monkeypatch.setattr(placement, "make_generation_backend", lambda *a, **k: fake)

    def trainer():
        raise RuntimeError("trainer build failed")

    with pytest.raises(RuntimeError, match="trainer build failed"):
        build_overlapped(_cfg(), "unused", tokenizer=None, device="cpu", weight_version=0, make_trainer=trainer,
                         echo=None)
    assert fake.closed


def test_build_overlapped_raises_the_generation_error(monkeypatch):
    import rl_core.launch.placement as placement

    def generation(*a, **k):
        raise FileNotFoundError("no weights")

    monkeypatch.setattr(placement, "make_generation_backend", generation)
    with pytest.raises(FileNotFoundError, match="no weights"):
        build_overlapped(_cfg(), "unused", tokenizer=None, device="cpu", weight_version=0,
                         make_trainer=lambda: "trainer", echo=None)


def test_vllm_helpers_without_vllm():
    """The request translation and version spans need no vLLM installed."""
    from rl_core.generation.vllm.common import check_request, to_vllm_sampling, token_versions_from_spans
    from rl_core.types import SamplingParams

    kw = to_vllm_sampling(SamplingParams(greedy=True, temperature=0.7, top_p=0.5, max_tokens=5, seed=3,
                                         stop_strings=("\n",), stop_token_ids=(2,)))
    assert kw["temperature"] == 0.0 and kw["top_p"] == 1.0 and kw["logprobs"] == 0 and kw["stop"] == ["\n"]
    assert kw["stop_token_ids"] == [2] and kw["detokenize"] is True and kw["seed"] == 3
    assert to_vllm_sampling(SamplingParams(temperature=0.7))["detokenize"] is False
    with pytest.raises(ValueError, match="top_k"):
        check_request(SamplingParams(top_k=3))
    spans = [{"version": "0", "start": 0, "end": 2}, {"version": "1", "start": 2, "end": 5}]
    assert token_versions_from_spans(spans, 5, fallback=9) == [0, 0, 1, 1, 1]
    assert token_versions_from_spans(None, 3, fallback=4) == [4, 4, 4]
    assert token_versions_from_spans([{"version": None, "start": 0, "end": 3}], 3, fallback=2) == [2, 2, 2]
