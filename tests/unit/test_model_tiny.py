"""The tiny model: shape, seeding, atomic HF directory, offline reload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_core.config.schema import TinyModelConfig
from rl_core.data.dataset import load_jsonl
from rl_core.model.tiny import build_tiny_model, num_parameters, save_hf_dir, write_dir_atomically
from rl_core.model.tokenizer import GENERIC_CORPUS, build_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300, model_max_length=64)


def test_build_shapes_ids_and_dtype(tok):
    cfg = TinyModelConfig()
    model = build_tiny_model(cfg, tok, seed=0)
    c = model.config
    assert c.model_type == "qwen2" and c.vocab_size == len(tok) == 300
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (128, 2, 4)
    assert c.eos_token_id == c.pad_token_id == c.bos_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.get_input_embeddings().weight is not model.get_output_embeddings().weight  # untied by default
    assert num_parameters(model) == 564_096 + 300 * 128
    tied = build_tiny_model(TinyModelConfig(tie_word_embeddings=True), tok, seed=0)
    assert tied.get_input_embeddings().weight is tied.get_output_embeddings().weight
    assert num_parameters(tied) == 564_096
    llama = build_tiny_model(TinyModelConfig(architecture="llama", hidden_size=64), tok, seed=0)
    assert llama.config.model_type == "llama"


def test_seed_fixes_the_weights_and_leaves_the_global_rng_alone(tok):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_model(TinyModelConfig(), tok, seed=7)
    assert torch.equal(torch.rand(3), expected_next)
    b = build_tiny_model(TinyModelConfig(), tok, seed=7)
    c = build_tiny_model(TinyModelConfig(), tok, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


_RELOAD = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, texts = sys.argv[1], json.loads(sys.argv[2])
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
ids = torch.tensor([tok.encode("07+45=", add_special_tokens=False)])
print(json.dumps({
    "encodings": [tok.encode(t, add_special_tokens=False) for t in texts],
    "eos": tok.eos_token_id, "pad": tok.pad_token_id, "template": tok.chat_template is not None,
    "gen_eos": model.generation_config.eos_token_id,
    "logits": model(ids).logits[0, -1, :5].tolist(),
}))
"""


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_save_and_reload_offline(tok, tmp_path, arch):
    model = build_tiny_model(TinyModelConfig(architecture=arch), tok, seed=0)
    out = save_hf_dir(model, tok, tmp_path / "policy", extra_json={"note.json": {"hello": 1}})
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "note.json"} <= names
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]  # no temporary directory left beside it

    texts = ["07+45=250<|endoftext|>", "<|im_start|>user\nhi<|im_end|>\n", "a  1\n\n 2", *GENERIC_CORPUS]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", _RELOAD, str(out), json.dumps(texts)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # the reloaded tokenizer (Qwen2Tokenizer for qwen2) encodes exactly like the one built here
    assert got["encodings"] == [tok.encode(t, add_special_tokens=False) for t in texts]
    assert (got["eos"], got["pad"], got["gen_eos"]) == (0, 0, 0) and got["template"]
    with torch.no_grad():
        ref = model(torch.tensor([tok.encode("07+45=", add_special_tokens=False)])).logits[0, -1, :5]
    assert torch.allclose(torch.tensor(got["logits"]), ref, atol=1e-5)
    saved = load_file(out / "model.safetensors")
    assert torch.equal(saved["model.embed_tokens.weight"], model.state_dict()["model.embed_tokens.weight"])


def test_save_replaces_an_existing_directory_atomically(tok, tmp_path):
    """A directory rl_core wrote (it carries the marker) is replaced as a whole."""
    from rl_core.fsutil import write_marker

    out = tmp_path / "policy"
    out.mkdir()
    write_marker(out, "test")
    (out / "stale.txt").write_text("old")
    save_hf_dir(build_tiny_model(TinyModelConfig(), tok, seed=0), tok, out)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]
    assert json.loads((out / ".rl_core-output").read_text())["written_by"] == "rl_core policy"


def test_save_refuses_a_users_directory_and_a_file(tok, tmp_path):
    """Issue 13: a directory without rl_core's marker, or a file, is never deleted or overwritten."""
    from rl_core.errors import OutputPathError

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    model = build_tiny_model(TinyModelConfig(), tok, seed=0)
    with pytest.raises(OutputPathError, match="not written by rl_core"):
        save_hf_dir(model, tok, out)
    assert (out / "notes.txt").read_text() == "mine" and [p.name for p in out.iterdir()] == ["notes.txt"]
    f = tmp_path / "file"
    f.write_text("data")
    with pytest.raises(OutputPathError, match="not a directory"):
        save_hf_dir(model, tok, f)
    assert f.read_text() == "data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine"]  # no temporaries left


def test_saved_files_are_world_readable_like_other_files(tok, tmp_path):
    """Issue 13: save_pretrained writes model.safetensors 0600; rl_core's directories use the
    mode an ordinary open() gives (0644 under umask 022)."""
    import os

    old = os.umask(0o022)
    try:
        out = save_hf_dir(build_tiny_model(TinyModelConfig(), tok, seed=0), tok, tmp_path / "p")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes


def test_failed_write_leaves_the_old_directory(tmp_path):
    from rl_core.fsutil import write_marker

    out = tmp_path / "policy"
    out.mkdir()
    write_marker(out, "test")
    (out / "keep.txt").write_text("old")

    def fill(tmp):
        (tmp / "half.txt").write_text("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_dir_atomically(out, fill)
    assert (out / "keep.txt").read_text() == "old" and not (out / "half.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]
