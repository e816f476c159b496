"""Filesystem weight handoff: versioned safetensors directories, a ready marker written last,
old versions cleaned up, bytes and seconds reported, and a real engine refitted from it."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rl_core.generation import EngineOptions, NativeBackend, NativeEngine
from rl_core.weights import (FilesystemWeightSync, InProcessSync, latest_ready_version, read_version,
                             state_dict_bytes, version_dir, wait_for_version)
from rl_core.weights.filesystem import LATEST, READY


def tiny_model(seed: int):
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=50, intermediate_size=64, max_position_embeddings=32, tie_word_embeddings=True,
                      initializer_range=0.3)
    return Qwen2ForCausalLM(cfg).eval()


def test_write_read_round_trip_with_tied_and_mixed_dtypes(tmp_path):
    model = tiny_model(0)
    weights = dict(model.state_dict())
    weights["extra.bf16"] = torch.randn(3, 5).to(torch.bfloat16)
    sync = FilesystemWeightSync(tmp_path / "w", max_shard_mb=0.01)  # ~10 KB shards: several files
    report = sync.write(3, weights)
    d = version_dir(tmp_path / "w", 3)
    marker = json.loads((d / READY).read_text())
    assert marker["version"] == 3 and len(marker["files"]) > 1
    assert report.bytes == sum(t.numel() * t.element_size() for n, t in weights.items() if n != "lm_head.weight")
    assert report.seconds > 0 and report.bytes_per_s > 0
    back = read_version(tmp_path / "w", 3)
    assert sorted(back) == sorted(weights)
    for k, v in weights.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    assert json.loads((tmp_path / "w" / LATEST).read_text())["version"] == 3


def test_old_versions_are_removed_and_partial_ones_never_read(tmp_path):
    root = tmp_path / "w"
    weights = {"a": torch.arange(10.0)}
    sync = FilesystemWeightSync(root, keep_last_versions=2)
    for v in range(5):
        sync.write(v, {"a": weights["a"] + v})
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("v")) == ["v000000003", "v000000004"]
    assert latest_ready_version(root) == 4
    with pytest.raises(FileNotFoundError, match="weight version 1 is not ready"):
        read_version(root, 1)
    # a directory renamed into place without its marker (writer killed) is not a version
    unready = version_dir(root, 9)
    unready.mkdir()
    (unready / "model-00001-of-00001.safetensors").write_bytes(b"garbage")
    (root / ".v000000010.tmp-123").mkdir()
    assert latest_ready_version(root) == 4
    FilesystemWeightSync(root)  # a new writer clears both leftovers
    assert not unready.exists() and not (root / ".v000000010.tmp-123").exists()
    # a truncated file is caught against the marker
    f = next(version_dir(root, 4).glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:-3])
    with pytest.raises(OSError, match="corrupt"):
        read_version(root, 4)


def test_wait_for_version(tmp_path):
    root = tmp_path / "w"
    sync = FilesystemWeightSync(root)
    with pytest.raises(TimeoutError, match="no weight version >= 1"):
        wait_for_version(root, 1, timeout_s=0.2)
    threading.Timer(0.3, lambda: sync.write(1, {"a": torch.ones(2)})).start()
    assert wait_for_version(root, 1, timeout_s=10) == 1


def test_push_refits_a_native_backend_from_the_directory(tmp_path):
    old, new = tiny_model(0), tiny_model(1)
    engine = NativeEngine(old.config, old.state_dict(), EngineOptions(max_batch_size=4))
    backend = NativeBackend(engine)
    ids = torch.randint(0, 50, (2, 9))

    async def go():
        await backend.start()
        try:
            return await FilesystemWeightSync(tmp_path / "w").push(7, new.state_dict(), [backend])
        finally:
            await backend.shutdown()

    report = asyncio.run(go())
    assert report.kind == "filesystem" and report.parts["write_s"] > 0 and report.parts["load_s"] > 0
    assert report.bytes == state_dict_bytes(new.state_dict()) > 0
    assert backend.weight_version == 7
    with torch.no_grad():
        assert (engine.model.sequence_logits(ids) - new(ids).logits).abs().max().item() < 1e-4


def test_in_process_sync_reports_bytes_and_seconds():
    model = tiny_model(2)
    backend = NativeBackend(NativeEngine(tiny_model(0).config, tiny_model(0).state_dict(),
                                         EngineOptions(max_batch_size=4)))

    async def go():
        await backend.start()
        try:
            return await InProcessSync().push(4, model.state_dict(), [backend])
        finally:
            await backend.shutdown()

    report = asyncio.run(go())
    assert report.kind == "in_process" and report.version == 4 and report.seconds > 0
    assert report.bytes == state_dict_bytes(model.state_dict())
    assert backend.weight_version == 4
