"""The long-tail tasks' generator: the shipped repeat files are its output, the lengths are
long-tailed as documented, the answers are what each kind says, and the tiny tokenizer sees
one token per digit."""

from __future__ import annotations

import json
import random

import pytest

from rl_core.data.longtail import longtail_examples, make_longtail_data, sample_length
from tests.helpers.paths import ROOT


def test_shipped_repeat_data_is_the_generator_output(tmp_path):
    summary = make_longtail_data(tmp_path)
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / name).read_bytes() == (ROOT / "data" / "repeat" / name).read_bytes()
    assert (summary["p50"], summary["p99"], summary["max"]) == (49, 1015, 1099)
    assert summary["p99"] / summary["p50"] >= 5 and summary["max"] + 1 >= 1024  # + the end token


@pytest.mark.parametrize("kind", ["repeat", "copy"])
def test_answers_and_lengths(kind):
    examples = longtail_examples(500, kind, min_len=3, max_len=40, seed=7)
    assert examples == longtail_examples(500, kind, min_len=3, max_len=40, seed=7)
    for ex in examples:
        assert 3 <= ex["length"] == len(ex["answer"]) <= 40 and ex["answer"].isdigit()
        if kind == "repeat":
            assert ex["prompt"] == f"repeat:{ex['answer'][0]}x{ex['length']}=" and len(set(ex["answer"])) == 1
        else:
            assert ex["prompt"] == f"copy:{ex['answer']}="
    lengths = sorted(ex["length"] for ex in examples)
    assert lengths[0] == 3 and lengths[-1] >= 35 and lengths[len(lengths) // 2] < 15  # log-uniform: median ~11
    with pytest.raises(ValueError, match="min_len"):
        longtail_examples(3, kind, min_len=5, max_len=4)
    with pytest.raises(ValueError, match="kind"):
        longtail_examples(3, "count")


def test_sample_length_is_clamped():
    rng = random.Random(0)
    assert all(2 <= sample_length(rng, 2, 9) <= 9 for _ in range(1000))


def test_the_tiny_tokenizer_gives_one_token_per_digit():
    from rl_core.config.schema import AdditionEnvConfig
    from rl_core.envs import make_env
    from rl_core.model.tokenizer import build_tokenizer

    rows = [json.loads(line) for line in (ROOT / "data" / "repeat" / "val.jsonl").read_text().splitlines()[:20]]
    env = make_env(AdditionEnvConfig(), build_tokenizer(rows, 300))
    for ex in rows:
        assert len(env.reference_completion_ids(ex)) == ex["length"] + 1
