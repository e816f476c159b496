"""Which checkpoints the evaluate stage picks, and the sampling it evaluates with."""

from __future__ import annotations

import json

import pytest

from rl_core.config import read_recipe
from rl_core.errors import CheckpointError
from rl_core.launch.evaluate import choose_checkpoints, eval_sets, evaluation_validation_config


def _epochs(tmp_path, accuracies):
    out = {}
    for k, acc in enumerate(accuracies, start=1):
        v = tmp_path / f"v{k}.json"
        v.write_text(json.dumps({"accuracy": acc}))
        out[k] = {"checkpoint": f"results/r/epoch_{k}/checkpoint", "validation": str(v)}
    return out


@pytest.fixture
def cfg():
    return read_recipe("recipes/tiny-addition.yaml")


def test_final_and_best(tmp_path, cfg):
    chosen = choose_checkpoints(cfg, _epochs(tmp_path, [0.2, 0.5, 0.3]))
    assert {k: c["labels"] for k, c in chosen.items()} == {3: ["final"], 2: ["best"]}
    assert chosen[2]["checkpoint"] == "results/r/epoch_2/checkpoint" and chosen[2]["val_accuracy"] == 0.5


def test_one_checkpoint_with_both_labels_and_ties_go_to_the_later_epoch(tmp_path, cfg):
    chosen = choose_checkpoints(cfg, _epochs(tmp_path, [0.5, 0.5]))
    assert {k: c["labels"] for k, c in chosen.items()} == {2: ["final", "best"]}
    only_best = read_recipe("recipes/tiny-addition.yaml", ["evaluation.checkpoints=[best]"])
    assert list(choose_checkpoints(only_best, _epochs(tmp_path, [0.6, 0.5]))) == [1]


def test_unreadable_validation_names_the_file(tmp_path, cfg):
    epochs = _epochs(tmp_path, [0.1])
    epochs[1]["validation"] = str(tmp_path / "missing.json")
    with pytest.raises(CheckpointError, match=r"missing.json of epoch 1 cannot be read.*validate_epoch"):
        choose_checkpoints(cfg, epochs)


def test_eval_sets_and_sampling(cfg):
    assert eval_sets(cfg) == {"val": cfg.data.val_file}
    v = evaluation_validation_config(cfg)
    assert v.num_val_generations_per_prompt == 4 and v.sampling.temperature == 1.0 and not v.sampling.greedy
    other = read_recipe("recipes/tiny-addition.yaml", ["evaluation.sets={a: data/addition/val.jsonl}",
                                                       "evaluation.max_samples=7"])
    assert eval_sets(other) == {"a": "data/addition/val.jsonl"}
    assert evaluation_validation_config(other).max_val_samples == 7
