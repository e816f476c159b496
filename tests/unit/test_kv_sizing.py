"""KV-cache sizing of `rl-core serve`: bytes per slot, the default (a fixed batch of
full-context sequences: what the model needs, not a share of the machine), slots from a
memory share when asked, and clear errors naming the flags when the cache cannot fit. Plus
SmolLM2 served with default flags: its peak resident memory stays within 2 GB and it says
how its cache was sized."""

from __future__ import annotations

import json
import urllib.request

import pytest

from rl_core.generation.native.kv_sizing import DEFAULT_SLOTS, GIB, KVSizingError, kv_bytes_per_slot, plan_kv_slots
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


def test_the_default_is_a_batch_of_full_context_sequences_whatever_the_memory():
    per_slot = kv_bytes_per_slot(SMOL, 4096, "float32")
    for available in (3 * GIB, 20 * GIB, 200 * GIB):  # the machine's size does not matter
        plan = plan_kv_slots(SMOL, 4096, "float32", "auto", available, requested=None, fraction=None)
        assert plan.slots == DEFAULT_SLOTS == 4 and plan.total == 4 * per_slot
    assert "4 slots x 4096 tokens = 0.70 GiB" in plan.describe(4096) and "sized for the model" in plan.describe(4096)
    with pytest.raises(KVSizingError, match="the default --max-batch-size 4 .*at most the 0.5 GiB available"):
        plan_kv_slots(SMOL, 4096, "float32", "auto", GIB // 2, None, None)


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
    assert f"[serve] KV cache: {DEFAULT_SLOTS} slots x 512 tokens" in log  # the default batch, at the 512-token context


def _peak_rss_bytes(pid: int) -> int:
    """VmHWM of /proc/<pid>/status: the process's peak resident set (Linux)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM line")


def test_smollm2_with_default_flags_stays_within_2_gb(tmp_path):
    from rl_core.model import gguf

    try:
        model = gguf.smollm2_hf_dir()
    except gguf.ModelFileError as exc:
        pytest.skip(str(exc))
    with running_server(model, tmp_path / "srv", timeout_s=300) as (url, proc):
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
            name = json.loads(r.read())["data"][0]["id"]
        body = json.dumps({"model": name, "prompt": "The capital of France is", "max_tokens": 16, "n": 4}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert len(json.loads(r.read())["choices"]) == 4
        peak = _peak_rss_bytes(proc.pid)  # loading, the cache and a request of 4 choices
    log = next((tmp_path / "srv").glob("*.log")).read_text()
    line = next(ln for ln in log.splitlines() if ln.startswith("[serve] KV cache:"))
    assert "4 slots x 4096 tokens" in line and "sized for the model" in line, line
    assert peak <= 2 * 10**9, f"peak resident memory {peak / 1e9:.2f} GB > 2 GB; {line}"
