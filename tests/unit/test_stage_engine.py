"""The validation and evaluation stages build the recipe's native engine (`generation.native`),
the same as the training run's: a stage of a model with a long context (SmolLM2: 8,192) must
not size its KV cache for that context at the default batch (it ran out of memory)."""

from __future__ import annotations

from rl_core.generation import make_native_engine
from tests.helpers.engine_models import tiny_model
from tests.helpers.recipes import recipe


def test_the_stage_engine_takes_the_recipes_native_section(tmp_path):
    model = tiny_model(max_positions=4096)
    model.save_pretrained(tmp_path)
    cfg = recipe(generation={"max_batch_size": 16, "native": {"max_seq_len": 48, "max_num_kv_tokens": 400}})
    engine = make_native_engine(cfg, tmp_path, tokenizer=None, device="cpu")
    assert (engine.max_seq_len, engine.max_num_kv_tokens, engine.max_batch_size) == (48, 400, 16)
    default = make_native_engine(recipe(), tmp_path, tokenizer=None, device="cpu", weight_version=3)
    assert default.max_seq_len == 4096 and default.weight_version == 3
