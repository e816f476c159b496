"""The addition task generator: shipped files, split, answer format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_core.data.addition import (all_examples, format_answer, format_prompt, make_addition_data,
                                   parse_answer, split_examples)

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "data" / "addition"


def test_generator_reproduces_shipped_files_byte_for_byte(tmp_path):
    summary = make_addition_data(tmp_path)
    assert summary["num_train"] == 9000 and summary["num_val"] == 1000
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / name).read_bytes() == (SHIPPED / name).read_bytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl", "val.jsonl"]  # no temp files left


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_split_sizes_disjoint_and_complete():
    train, val = _read(SHIPPED / "train.jsonl"), _read(SHIPPED / "val.jsonl")
    assert len(train) == 9000 and len(val) == 1000
    train_ids, val_ids = {ex["id"] for ex in train}, {ex["id"] for ex in val}
    assert len(train_ids) == 9000 and len(val_ids) == 1000
    assert not train_ids & val_ids
    assert train_ids | val_ids == set(range(10_000))


def test_every_line_has_the_documented_shape():
    for ex in _read(SHIPPED / "val.jsonl") + _read(SHIPPED / "train.jsonl"):
        assert list(ex) == ["id", "prompt", "answer", "a", "b"]
        a, b = ex["a"], ex["b"]
        assert ex["id"] == a * 100 + b
        assert ex["prompt"] == f"{a:02d}+{b:02d}="
        assert len(ex["answer"]) == 3 and ex["answer"].isdigit()
        assert int(ex["answer"][::-1]) == a + b


def test_answer_format_examples():
    assert format_prompt(7, 45, 2) == "07+45="
    assert format_answer(52, 2) == "250"
    assert format_answer(0, 2) == "000"
    assert format_answer(198, 2) == "891"
    assert format_answer(1998, 3) == "8991"
    with pytest.raises(ValueError):
        format_answer(1000, 2)
    assert parse_answer("250") == 52
    assert parse_answer("25a") is None and parse_answer("") is None and parse_answer("٣") is None


def test_split_depends_on_seed_only(tmp_path):
    examples = all_examples(1)  # 100 pairs
    t0, v0 = split_examples(examples, 10, seed=0)
    t0b, v0b = split_examples(examples, 10, seed=0)
    t1, v1 = split_examples(examples, 10, seed=1)
    assert (t0, v0) == (t0b, v0b)
    assert [e["id"] for e in v0] != [e["id"] for e in v1]
    summary = make_addition_data(tmp_path, num_digits=1, num_val=10, seed=0)
    assert summary["num_train"] == 90
    assert _read(tmp_path / "val.jsonl") == v0


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="num_val"):
        make_addition_data(tmp_path, num_digits=1, num_val=100)
    with pytest.raises(ValueError, match="num_digits"):
        make_addition_data(tmp_path, num_digits=4)
