"""KV-cache sizing of `rl-core serve`: bytes per slot, slots from the memory available, and
clear errors naming the flags when the cache cannot fit. Plus SmolLM2 served with default
flags: it starts within this machine's memory and says how its cache was sized."""

from __future__ import annotations

import json
import urllib.request

import pytest

from rl_core.generation.native.kv_sizing import GIB, KVSizingError, kv_bytes_per_slot, plan_kv_slots
from rl_core.generation.native.model import ModelSpec
from rl_core.launch.cli import main

from tests.helpers.serving import make_model_dir, running_server

# SmolLM2-135M's attention shape: 30 layers, 3 KV heads of 64
SMOL = ModelSpec(model_type="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                 head_dim=64, intermediate_size=1536, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192,
                 qkv_bias=False, o_bias=False, mlp_bias=False, tie_word_embeddings=True, eos_token_ids=(2,))


def test_bytes_per_slot_are_what_the_cache_allocates():
    import torch

    from rl_core.generation.native.kv_cache import KVCache

    cache = KVCache(3, 5, 32, 2, 8, dtype=torch.float32)
    spec = ModelSpec(**{**SMOL.__dict__, "num_layers": 3, "num_kv_heads": 2, "head_dim": 8})
    assert kv_bytes_per_slot(spec, 32, "float32") * 5 == cache.nbytes
    assert kv_bytes_per_slot(spec, 32, "bfloat16") * 2 == kv_bytes_per_slot(spec, 32, "float32")
    assert kv_bytes_per_slot(spec, 32, "float32", "fp8_e4m3") * 4 == kv_bytes_per_slot(spec, 32, "float32")


def test_slots_from_memory_are_capped_and_fit_the_fraction():
    per_slot = kv_bytes_per_slot(SMOL, 4096, "float32")  # 180 MiB
    plan = plan_kv_slots(SMOL, 4096, "float32", "auto", available=20 * GIB, requested=None, fraction=0.3)
    assert plan.slots == int(0.3 * 20 * GIB) // per_slot == 34 and plan.total <= 0.3 * 20 * GIB
    assert plan_kv_slots(SMOL, 512, "float32", "auto", 20 * GIB, None, 0.3).slots == 256  # the cap
    assert "34 slots x 4096 tokens" in plan.describe(4096)


def test_a_cache_that_cannot_fit_names_the_flags():
    with pytest.raises(KVSizingError, match="--max-seq-len.*--kv-cache-memory-fraction"):
        plan_kv_slots(SMOL, 8192, "float32", "auto", available=1 * GIB, requested=None, fraction=0.3)
    with pytest.raises(KVSizingError, match="--max-batch-size 256 .*at most the 20.0 GiB available"):
        plan_kv_slots(SMOL, 8192, "float32", "auto", available=20 * GIB, requested=256, fraction=0.3)
    assert plan_kv_slots(SMOL, 8192, "float32", "auto", 20 * GIB, 8, 0.3).slots == 8  # explicit and fits


@pytest.mark.parametrize("flags, named", [
    (["--kv-cache-memory-fraction", "0"], "--kv-cache-memory-fraction"),
    (["--kv-cache-memory-fraction", "1.5"], "--kv-cache-memory-fraction"),
    (["--max-batch-size", "0"], "--max-batch-size"),
    (["--max-batch-size", "100000000"], "--max-batch-size 100000000"),
])
def test_serve_flags_that_cannot_size_the_cache_exit_2(tmp_path, capsys, flags, named):
    model = make_model_dir(tmp_path / "model")
    assert main(["serve", str(model), "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_default_flags_size_the_cache_and_serve(tmp_path):
    model = make_model_dir(tmp_path / "model")
    with running_server(model, tmp_path / "srv") as (url, _):
        body = json.dumps({"model": "model", "prompt": "hello", "max_tokens": 3, "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] >= 1
    log = next((tmp_path / "srv").glob("*.log")).read_text()
    assert "[serve] KV cache: 256 slots x 512 tokens" in log  # a tiny model: the cap, at its 512-token context


def test_smollm2_with_default_flags_starts_within_memory(tmp_path):
    from rl_core.model import gguf

    try:
        model = gguf.smollm2_hf_dir()
    except gguf.ModelFileError as exc:
        pytest.skip(str(exc))
    with running_server(model, tmp_path / "srv", timeout_s=300) as (url, _):
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
            assert json.loads(r.read())["data"]
    log = next((tmp_path / "srv").glob("*.log")).read_text()
    line = next(ln for ln in log.splitlines() if ln.startswith("[serve] KV cache:"))
    assert "sized from memory" in line and "x 4096 tokens" in line, line
