"""A drawn batch's prompts encoded in one tokenizer call (`BaseEnv.prompt_ids_many`, used by
the rollout pump; issue 18 item 3): the ids must equal `prompt_ids` of each example, every
environment or tokenizer where that is not guaranteed must keep one `prompt_ids` per group,
and a controller run must hand the backend the same prompts."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

from rl_core.config import validate_dict
from rl_core.config.schema import AdditionEnvConfig
from rl_core.controller.controller import Controller
from rl_core.data.addition import all_examples
from rl_core.data.dataset import PromptSource, load_jsonl
from rl_core.envs import make_env
from rl_core.envs.base import BaseEnv
from rl_core.model.tokenizer import SPECIAL_TOKENS, build_tokenizer
from tests.helpers.fakes import FakeBackend, FakeTokenizer, make_parts

TRICKY = ["", " ", "  07+45=", "\n\n", "\t x \r\n y ", "Größe – 数字 ✓ 07+45=", "a" * 3000,
          "12+34=" * 200, "\ufffd\x00", "'s 're 'll ' ve"]
TRICKY += [f"x {t} y{t}" for t in SPECIAL_TOKENS] + list(SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300)


def _examples() -> list[dict]:
    pairs = all_examples()
    exs = [dict(pairs[(i * 37) % len(pairs)], id=i) for i in range(400)]
    return exs + [{"id": 1000 + i, "prompt": t, "answer": "0"} for i, t in enumerate(TRICKY)]


def test_a_batch_encodes_to_each_prompts_ids(tok):
    env = make_env(AdditionEnvConfig(), tok)
    exs = _examples()
    want = [env.prompt_ids(e) for e in exs]
    got = env.prompt_ids_many(exs)
    assert got == want
    assert all(type(ids) is list and all(type(i) is int for i in ids) for ids in got)
    assert [] in want and max(map(len, want)) > 1000  # the empty and the long prompt are in
    assert env.prompt_ids_many([]) == []


def test_the_tokenizer_a_run_reloads_encodes_a_batch_the_same(tok, tmp_path):
    """A run reloads the tokenizer from its policy directory (transformers' Qwen2Tokenizer class,
    as for Qwen models): the batch path applies and gives the same ids."""
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert type(loaded).__name__ == "Qwen2Tokenizer"
    env = make_env(AdditionEnvConfig(), loaded)
    exs = _examples()
    got = env.prompt_ids_many(exs)
    assert got is not None and got == [env.prompt_ids(e) for e in exs]


def test_where_a_batch_is_not_guaranteed_each_group_encodes_its_own(tok):
    exs = _examples()[:5]

    class OwnIds(type(make_env(AdditionEnvConfig(), tok))):
        def prompt_ids(self, example):
            return [1] + super().prompt_ids(example)

    assert OwnIds(AdditionEnvConfig(), tok).prompt_ids_many(exs) is None  # a subclass's prompt_ids is never bypassed

    chat = make_env(AdditionEnvConfig(), tok)
    chat.use_chat_template = True
    assert chat.prompt_ids_many(exs) is None

    class Fake(BaseEnv):
        def score_completion(self, example, completion):
            raise AssertionError

    class PlainTokenizer(FakeTokenizer):
        def convert_ids_to_tokens(self, i):
            return "<eos>"

        def encode(self, text, add_special_tokens=False):
            return [ord(c) % 50 for c in text]

    fake = Fake(None, PlainTokenizer())
    assert fake.prompt_ids_many(exs) is None  # not a transformers tokenizer
    assert fake.prompt_ids(exs[0]) == [ord(c) % 50 for c in exs[0]["prompt"]]  # (its path, as before)

    class OwnEncode(type(tok)):
        def encode(self, text, *args, **kwargs):
            return [7] + super().encode(text, *args, **kwargs)

    class OwnEncodePlus(type(tok)):
        def _encode_plus(self, *args, **kwargs):
            raise AssertionError("never called: the batch is refused first")

    for cls in (OwnEncode, OwnEncodePlus):  # a tokenizer subclass with its own encoding step
        own = copy.copy(tok)
        own.__class__ = cls
        assert make_env(AdditionEnvConfig(), own).prompt_ids_many(exs) is None


def test_a_controller_run_hands_the_backend_the_batch_encoded_prompts(tok, tmp_path, monkeypatch):
    """Every group's requests carry `prompt_ids(example)`; the pump encoded them with their
    batch (no `prompt_ids` call per group) and derived their seeds with it, also for the
    first batch, whose groups start after the lookahead's second batch is drawn."""
    n_groups, n = 4, 2
    cfg = validate_dict({"grpo": {"num_prompts_per_step": n_groups, "num_generations_per_prompt": n,
                                  "max_num_steps": 3},
                         "async_rl": {"sampler": {"type": "in_order", "max_lookahead_versions": 1},
                                      "max_inflight_groups": 2 * n_groups, "max_buffered_groups": 2 * n_groups},
                         "validation": {"val_at_start": False, "val_at_end": False},
                         "logging": {"tensorboard": False, "jsonl": False, "progress": "off"}})
    env = make_env(AdditionEnvConfig(), tok)
    examples = _examples()[:40]
    seen: dict[str, list[int]] = {}

    class Recording(FakeBackend):
        async def generate(self, request):
            seen[request.request_id] = list(request.prompt_ids)
            return await super().generate(request)

    parts = make_parts(cfg, backend=Recording(seed=1))
    parts.env, parts.tokenizer = env, tok
    parts.source = PromptSource(examples, n_groups, shuffle=True, seed=cfg.grpo.seed,
                                max_num_epochs=cfg.grpo.max_num_epochs)
    calls = []
    fresh = BaseEnv.prompt_ids
    monkeypatch.setattr(BaseEnv, "prompt_ids", lambda self, ex: calls.append(ex) or fresh(self, ex))
    derived = []  # seeds derived per group: none either, every group's came with its batch
    from rl_core.rollout import group as group_mod
    seeds_last = group_mod.seeds_last
    monkeypatch.setattr(group_mod, "seeds_last", lambda *a: derived.append(a) or seeds_last(*a))
    summary = asyncio.run(Controller(cfg, parts, tmp_path, total_steps=3).run())
    assert summary["rl_steps"] == 3
    assert calls == [] and derived == []  # every group's prompt and seeds came from its batch
    assert len(seen) >= 3 * n_groups * n
    for rid, prompt in seen.items():
        index = int(rid.split("/")[0].split("-")[1][1:])  # e{epoch}-p{index}-d{k}/a{attempt}/{i}
        assert prompt == fresh(env, examples[index]), rid
