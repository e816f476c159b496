"""Recipe loading: defaults, overrides, extends, and the promised error for bad input."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rl_core.config import apply_overrides, validate_dict
from rl_core.config.docs import render_docs
from rl_core.errors import RecipeError
from rl_core.launch.preflight import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-addition.yaml"


def test_shipped_recipes_validate(monkeypatch):
    monkeypatch.chdir(ROOT)
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        load_recipe(path)


def test_overrides_parse_yaml_values():
    data = apply_overrides({"grpo": {"seed": 1}}, ["grpo.seed=7", "loss.kl_coef=0.05", "generation.stop=[';']",
                                                   "grpo.max_num_epochs=null"])
    cfg = validate_dict(data)
    assert cfg.grpo.seed == 7 and cfg.loss.kl_coef == 0.05 and cfg.generation.stop == [";"]
    assert cfg.grpo.max_num_epochs is None


def test_extends_deep_merges(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    child = tmp_path / "child.yaml"
    child.write_text(f"extends: {RECIPE}\ngrpo: {{max_num_steps: 5}}\n")
    cfg = load_recipe(child)
    assert cfg.grpo.max_num_steps == 5 and cfg.grpo.num_prompts_per_step == 64  # the default recipe's


def test_discriminator_defaults_to_the_default_type():
    cfg = validate_dict({"async_rl": {"sampler": {"max_lookahead_versions": 0}}})
    assert cfg.async_rl.sampler.type == "in_order"


def test_docs_cover_every_field():
    text = render_docs()
    for needle in ("grpo.num_generations_per_prompt", "async_rl.sampler.max_lookahead_versions",
                   "loss.importance_sampling.truncation", "validation.sampling.greedy"):
        assert needle in text


def test_docs_reference_file_is_up_to_date():
    ref = ROOT / "docs" / "recipe-reference.md"
    assert ref.read_text() == render_docs("markdown"), "run: rl-core docs --format markdown > docs/recipe-reference.md"


BAD = {
    "unknown_key": ("grpo:\n  num_prompt_per_step: 4\n", "grpo.num_prompt_per_step", "did you mean `num_prompts_per_step`"),
    "wrong_type": ("trainer:\n  lr: fast\n", "trainer.lr", "valid number"),
    "group_too_small": ("grpo:\n  num_generations_per_prompt: 1\n", "grpo.num_generations_per_prompt", ">= 2"),
    "negative_lookahead": ("async_rl:\n  sampler: {type: in_order, max_lookahead_versions: -1}\n",
                           "async_rl.sampler.max_lookahead_versions", ">= 0"),
    "missing_data_file": ("data:\n  train_file: data/nope/train.jsonl\n", "data.train_file", "existing JSON-lines"),
    "unknown_sampler": ("async_rl:\n  sampler: {type: fifo}\n", "async_rl.sampler.type", "in_order"),
    "yaml_syntax": ("grpo: {seed: 1\n", "(YAML syntax)", "valid YAML"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_recipe_cli_error(name, tmp_path):
    body, field, expect = BAD[name]
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(f"extends: {RECIPE}\noutput_dir: {tmp_path / 'out'}\n" + body)
    # run the CLI in a fresh interpreter; also prove that nothing heavy was imported
    code = textwrap.dedent(f"""
        import sys
        from rl_core.launch.cli import main
        rc = main(["validate", {str(recipe)!r}])
        assert "torch" not in sys.modules, "validate imported torch"
        sys.exit(rc)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert f"`{field}`" in err and expect in err and "Fix:" in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.safetensors"))


def test_validate_writes_resolved_config(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rl_core.launch.cli", "validate", str(RECIPE), "--out", str(tmp_path),
                           "grpo.seed=3"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "resolved_config.json").read_text())
    assert data["grpo"]["seed"] == 3 and data["async_rl"]["sampler"]["type"] == "in_order"


def test_cross_field_errors():
    with pytest.raises(RecipeError, match="async_rl.max_buffered_groups"):
        validate_dict({"async_rl": {"max_buffered_groups": 2}})
    with pytest.raises(RecipeError, match="min_groups_for_streaming_train"):
        validate_dict({"async_rl": {"min_groups_for_streaming_train": 99}})
    with pytest.raises(RecipeError, match="model.path"):
        validate_dict({"model": {"source": "hf"}})
