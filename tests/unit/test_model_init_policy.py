"""init_policy: tiny (tokenizer + model + warm-up, reproducible) and hf (verified copy)."""

from __future__ import annotations

import json

import pytest
import torch

from rl_core.config.schema import RecipeConfig
from rl_core.errors import RecipeError
from rl_core.model import INIT_REPORT, init_policy, load_hf_dir


def _recipe(**model):
    warm = {"target_accuracy": 0.0, "max_steps": 20, "eval_every_steps": 5, "num_eval_prompts": 16}
    base = {"model": {"tiny": {"tie_word_embeddings": False}, "warmup": warm}, "grpo": {"seed": 3}}
    base["model"].update(model)
    return RecipeConfig.model_validate(base)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("init") / "policy"
    report = init_policy(_recipe(), out, log=None)
    return out, report


def test_tiny_init_writes_a_loadable_hf_dir_with_a_report(tiny_dir):
    out, report = tiny_dir
    on_disk = json.loads((out / INIT_REPORT).read_text())
    assert on_disk["warmup"]["steps"] == report["warmup"]["steps"] == 5  # target 0: stop at the first check
    assert on_disk["source"] == "tiny" and on_disk["seed"] == 3 and on_disk["vocab_size"] == 300
    assert on_disk["num_train"] == 9000 and on_disk["num_val"] == 1000 and on_disk["longest_prompt_tokens"] == 6
    model, tok = load_hf_dir(out)
    assert model.config.vocab_size == len(tok) == 300 and tok.eos_token_id == 0
    assert sum(p.numel() for p in model.parameters()) == report["num_parameters"]
    assert [p.name for p in out.parent.iterdir()] == ["policy"]


def test_same_recipe_same_weights(tiny_dir, tmp_path):
    out, _ = tiny_dir
    init_policy(_recipe(), tmp_path / "again", log=None)
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()


def test_warmup_can_be_disabled(tmp_path):
    report = init_policy(_recipe(warmup={"enabled": False}), tmp_path / "p", log=None)
    assert report["warmup"] == {"enabled": False}
    assert (tmp_path / "p" / "model.safetensors").is_file()


def test_prompt_must_fit_the_positions(tmp_path):
    cfg = RecipeConfig.model_validate({"model": {"tiny": {"max_position_embeddings": 9}},
                                       "generation": {"max_tokens": 4}})
    with pytest.raises(RecipeError, match=r"model\.tiny\.max_position_embeddings.*at least 10"):
        init_policy(cfg, tmp_path / "p", log=None)
    assert not (tmp_path / "p").exists()


def test_hf_source_copies_and_verifies(tiny_dir, tmp_path):
    src, _ = tiny_dir
    (src.parent / "extra").mkdir(exist_ok=True)
    cfg = RecipeConfig.model_validate({"model": {"source": "hf", "path": str(src)}})
    report = init_policy(cfg, tmp_path / "copy", log=None)
    assert report["source"] == "hf" and report["architecture"] == "qwen2" and report["vocab_size"] == 300
    assert "model.safetensors" in report["files"] and "tokenizer.json" in report["files"]
    assert INIT_REPORT not in report["files"]  # the source's own report is not carried over
    assert (tmp_path / "copy" / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "copy" / INIT_REPORT).read_text())["path"] == str(src)
    a, _ = load_hf_dir(src)
    b, _ = load_hf_dir(tmp_path / "copy")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_hf_source_without_weights_names_model_path(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    cfg = RecipeConfig.model_validate({"model": {"source": "hf", "path": str(tmp_path / "empty")}})
    with pytest.raises(RecipeError, match=r"model\.path"):
        init_policy(cfg, tmp_path / "out", log=None)
    assert not (tmp_path / "out").exists()


def test_hf_source_that_does_not_load_names_model_path(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    cfg = RecipeConfig.model_validate({"model": {"source": "hf", "path": str(bad)}})
    with pytest.raises(RecipeError, match=r"model\.path.*loading the copy failed"):
        init_policy(cfg, tmp_path / "out", log=None)
    assert [p.name for p in tmp_path.iterdir()] == ["bad"]  # no half-written output or temp dir


def _reuse(name, output_dir, **tiny):
    return RecipeConfig.model_validate({
        "output_dir": str(output_dir), "grpo": {"seed": 7},
        "model": {"tiny": {"tie_word_embeddings": False, **tiny}, "warmup": {"reuse_from": name}}})


def test_a_warmup_is_reused_by_run_name_or_path(tiny_dir, tmp_path):
    out, report = tiny_dir
    (tmp_path / "runs" / "earlier").mkdir(parents=True)
    (tmp_path / "runs" / "earlier" / "init_policy").symlink_to(out, target_is_directory=True)
    for name in ("earlier", str(out)):
        dest = tmp_path / f"p{len(name)}"
        reused = init_policy(_reuse(name, tmp_path / "runs"), dest, log=None)
        assert (dest / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
        assert reused["warmup"] == report["warmup"] and reused["seed"] == 3  # the warm-up's own record
        assert reused["reused_from"].endswith("init_policy") or reused["reused_from"] == str(out)
        assert json.loads((dest / INIT_REPORT).read_text())["reused_from"] == reused["reused_from"]


def test_a_reused_warmup_must_exist_and_match_the_recipe(tiny_dir, tmp_path):
    out, _ = tiny_dir
    with pytest.raises(RecipeError, match=r"model\.warmup\.reuse_from.*'nope'.*init-policy"):
        init_policy(_reuse("nope", tmp_path), tmp_path / "p", log=None)
    with pytest.raises(RecipeError, match=r"model\.warmup\.reuse_from.*model\.tiny\.hidden_size is 64 in the recipe "
                                          r"but 128 there"):
        init_policy(_reuse(str(out), tmp_path, hidden_size=64), tmp_path / "p", log=None)
    assert not (tmp_path / "p").exists()


def test_load_recipe_checks_a_reused_warmup_before_any_build(tiny_dir, tmp_path):
    from rl_core.launch.preflight import load_recipe
    from tests.helpers.paths import ROOT

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"extends: {ROOT}/recipes/tiny-addition.yaml\noutput_dir: {tmp_path / 'results'}\n"
                      f"data: {{train_file: {ROOT}/data/addition/train.jsonl, val_file: {ROOT}/data/addition/val.jsonl}}\n")
    with pytest.raises(RecipeError, match=r"model\.warmup\.reuse_from.*'earlier'.*init-policy"):
        load_recipe(recipe, ["model.warmup.reuse_from=earlier"])
    with pytest.raises(RecipeError, match=r"model\.warmup\.reuse_from.*model\.tiny\.hidden_size is 64 in the recipe"):
        load_recipe(recipe, [f"model.warmup.reuse_from={tiny_dir[0]}", "model.tiny.hidden_size=64"])
    assert not (tmp_path / "results").exists()  # refused before anything was written


def test_warmup_device_resolves_and_refuses_cuda_without_a_gpu(monkeypatch):
    import torch

    from rl_core.errors import RecipeError
    from rl_core.model.init_policy import warmup_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert warmup_device("auto") == "cpu" and warmup_device("cpu") == "cpu"
    with pytest.raises(RecipeError, match="model.warmup.device"):
        warmup_device("cuda")
