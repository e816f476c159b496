"""The model card's front matter names the base model where there is a Hub one (SmolLM2's,
or the `_name_or_path` of an HF `model.path` that is a Hub id, not a local path), and
huggingface_hub's card parser reads what rl_core writes."""

from __future__ import annotations

import json

from huggingface_hub import ModelCard

from rl_core.checkpoint.card import SMOLLM2_REPO, render_card, write_card

from tests.helpers.recipes import recipe


def _card(tmp_path, cfg, **kw) -> ModelCard:
    path = write_card(tmp_path / "policy", render_card(cfg.model_dump(mode="json"), rl_step=7, **kw))
    assert path.name == "README.md" and not list(path.parent.glob(".*tmp*"))  # written atomically, no leftovers
    return ModelCard.load(path)


def test_smollm2_names_its_hub_model(tmp_path):
    card = _card(tmp_path, recipe(model={"source": "smollm2"}, run_name="smol"))
    assert card.data.base_model == SMOLLM2_REPO and card.data.model_name == "smol"
    assert "# smol, RL step 7" in card.text and "held-out accuracy: not measured" in card.text


def test_an_hf_directory_names_its_hub_origin_only_when_it_has_one(tmp_path):
    for named, expected in (("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"), (str(tmp_path), None),
                            ("", None)):
        model = tmp_path / "base"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "_name_or_path": named}))
        held_out = {"accuracy": 0.625, "pass@4": 0.75, "num_prompts": 64, "weight_version": 7}
        card = _card(tmp_path, recipe(model={"source": "hf", "path": str(model)}), held_out=held_out)
        assert card.data.base_model == expected, named
        assert f"the HF model directory `{model}`" in card.text or f"(loaded from `{model}`)" in card.text
        assert "held-out accuracy: 0.6250 on 64 prompts (pass@4 0.7500), weight version 7" in card.text
