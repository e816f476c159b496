"""Supervised warm-up: packing, greedy decoding, a real (short) warm-up, the budget error."""

from __future__ import annotations

import pytest
import torch

from rl_core.config.schema import AdditionEnvConfig, TinyModelConfig, WarmupConfig
from rl_core.data.dataset import load_task_data
from rl_core.envs import make_env
from rl_core.errors import RecipeError
from rl_core.model.tiny import build_tiny_model
from rl_core.model.tokenizer import build_tokenizer
from rl_core.model.warmup import encode_sft_examples, greedy_accuracy, greedy_decode, warmup

# Untied embeddings: the setting whose warm-up is fast and reliable with the 300-token vocabulary.
TINY = TinyModelConfig(tie_word_embeddings=False)


@pytest.fixture(scope="module")
def task():
    train, val = load_task_data("data/addition/train.jsonl", "data/addition/val.jsonl")
    tok = build_tokenizer(train, 300, model_max_length=64)
    return train, val, tok, make_env(AdditionEnvConfig(), tok)


def test_completion_only_loss_mask():
    data = encode_sft_examples([[5, 6, 7], [5, 6]], [[8, 0], [9, 9, 0]], pad_id=0)
    assert data.input_ids.tolist() == [[5, 6, 7, 8, 0], [5, 6, 9, 9, 0]]
    assert data.loss_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]
    short = encode_sft_examples([[5]], [[8, 0]], pad_id=3)
    assert short.attention_mask.tolist() == [[1, 1, 1]]
    mixed = encode_sft_examples([[5, 6, 7], [5]], [[8, 0], [8, 0]], pad_id=3)
    assert mixed.input_ids.tolist()[1] == [5, 8, 0, 3, 3] and mixed.attention_mask.tolist()[1] == [1, 1, 1, 0, 0]
    assert mixed.loss_mask.tolist()[1] == [0, 1, 1, 0, 0]


def test_batched_greedy_decode_matches_one_at_a_time_and_generate(task):
    _, _, tok, _ = task
    torch.manual_seed(0)
    model = build_tiny_model(TINY, tok, seed=3)
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["07+45=", "the answer is", "1", "Please add 3"]]
    batched = greedy_decode(model, prompts, max_new_tokens=5, pad_id=tok.pad_token_id)
    single = [greedy_decode(model, [p], max_new_tokens=5, pad_id=tok.pad_token_id)[0] for p in prompts]
    assert batched == single
    generated = model.generate(torch.tensor([prompts[0]]), max_new_tokens=5, do_sample=False,
                               eos_token_id=None, min_new_tokens=5)
    assert generated[0, len(prompts[0]):].tolist() == single[0]
    assert model.training  # restored


def test_warmup_learns_and_reports(task):
    train, val, tok, env = task
    model = build_tiny_model(TINY, tok, seed=0)
    assert greedy_accuracy(model, env, val[:200]) == (0.0, 0)  # random init: never right
    lines = []
    cfg = WarmupConfig(target_accuracy=0.01, max_steps=150, eval_every_steps=10, num_eval_prompts=200)
    stats = warmup(model, env, train, val, cfg, seed=0, log=lines.append)
    assert stats["accuracy"] >= 0.01 and stats["steps"] <= 150 and stats["steps"] % 10 == 0
    assert stats["history"][-1]["accuracy"] == stats["accuracy"]
    assert stats["history"][0]["loss"] > 2 * stats["history"][-1]["loss"]  # the answer loss fell
    assert len(lines) == len(stats["history"]) and "warmup step 10/150" in lines[0]
    assert "held-out greedy accuracy" in lines[-1]
    assert greedy_accuracy(model, env, val[:200])[0] == stats["accuracy"]  # greedy: reproducible


def test_warmup_is_reproducible(task):
    train, val, tok, env = task
    cfg = WarmupConfig(target_accuracy=0.0, max_steps=20, eval_every_steps=8, num_eval_prompts=20)
    a, b = build_tiny_model(TINY, tok, seed=1), build_tiny_model(TINY, tok, seed=1)
    sa = warmup(a, env, train, val, cfg, seed=5, log=None)
    sb = warmup(b, env, train, val, cfg, seed=5, log=None)
    assert sa["steps"] == sb["steps"] == 8 and sa["loss"] == sb["loss"]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_unreached_target_names_max_steps(task):
    train, val, tok, env = task
    model = build_tiny_model(TINY, tok, seed=0)
    cfg = WarmupConfig(target_accuracy=1.0, max_steps=3, eval_every_steps=2, num_eval_prompts=10)
    with pytest.raises(RecipeError, match=r"model\.warmup\.max_steps.*got 3") as err:
        warmup(model, env, train, val, cfg, seed=0, log=None)
    assert "target_accuracy" in str(err.value)


def test_kv_cached_greedy_decode_and_stop_ids_match_the_full_recompute(task):
    """The GPU warm-up's check path (`use_cache`, `stop_ids`) gives the full-recompute tokens:
    left-padded prompts of different lengths, the KV cache, rows stopped early filled with pad."""
    _, _, tok, _ = task
    model = build_tiny_model(TINY, tok, seed=3)
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["07+45=", "the answer is", "1", "Please add 3"]]
    full = greedy_decode(model, prompts, max_new_tokens=7, pad_id=tok.pad_token_id)
    assert greedy_decode(model, prompts, max_new_tokens=7, pad_id=tok.pad_token_id, use_cache=True) == full
    stop = full[0][2]  # the third token of the first row: that row stops there
    stopped = greedy_decode(model, prompts, max_new_tokens=7, pad_id=tok.pad_token_id, stop_ids=[stop], use_cache=True)
    for row, ref in zip(stopped, full):
        cut = next((k for k, t in enumerate(ref) if t == stop), None)
        assert len(row) == 7
        assert row[:(cut + 1) if cut is not None else 7] == ref[:(cut + 1) if cut is not None else 7]
