"""The long-tail copy task's generator: the shipped files are its output, the lengths are
long-tailed as documented, the answers are the prompts' digits, and the tokenizer sees one
token per digit."""

from __future__ import annotations

import json

import pytest

from rl_core.data.copying import PREFIX, copy_examples, make_copy_data, sample_length
from tests.helpers.paths import ROOT


def test_shipped_copy_data_is_the_generator_output(tmp_path):
    summary = make_copy_data(tmp_path)
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / name).read_bytes() == (ROOT / "data" / "copy" / name).read_bytes()
    assert (summary["p50"], summary["p99"], summary["max"]) == (47, 1026, 1099)
    assert summary["p99"] / summary["p50"] >= 5 and summary["max"] + 1 >= 1024  # + the end token


def test_examples_copy_their_prompt_and_lengths_stay_in_range():
    examples = copy_examples(500, min_len=3, max_len=40, seed=7)
    assert examples == copy_examples(500, min_len=3, max_len=40, seed=7)
    for ex in examples:
        assert ex["prompt"] == f"{PREFIX}{ex['answer']}=" and ex["answer"].isdigit()
        assert 3 <= ex["length"] == len(ex["answer"]) <= 40
    lengths = sorted(ex["length"] for ex in examples)
    assert lengths[0] == 3 and lengths[-1] >= 35 and lengths[len(lengths) // 2] < 15  # log-uniform: median ~11
    with pytest.raises(ValueError, match="min_len"):
        copy_examples(3, min_len=5, max_len=4)


def test_sample_length_is_clamped():
    import random

    rng = random.Random(0)
    assert all(2 <= sample_length(rng, 2, 9) <= 9 for _ in range(1000))


def test_the_tiny_tokenizer_gives_one_token_per_digit():
    from rl_core.config.schema import AdditionEnvConfig
    from rl_core.envs import make_env
    from rl_core.model.tokenizer import build_tokenizer

    rows = [json.loads(line) for line in (ROOT / "data" / "copy" / "val.jsonl").read_text().splitlines()[:20]]
    env = make_env(AdditionEnvConfig(), build_tokenizer(rows, 300))
    for ex in rows:
        assert len(env.reference_completion_ids(ex)) == ex["length"] + 1
