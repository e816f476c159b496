"""A multi-turn environment on the real loop: observations are inside the completion,
masked out of the loss, with zero generation logprobs; the episode has two turns."""

from __future__ import annotations

import asyncio
import json

from rl_core.launch.preflight import load_recipe
from rl_core.controller.controller import Controller
from rl_core.launch.train import build_parts

from tests.helpers.paths import ROOT, TINY_RECIPE as RECIPE


def test_chain_addition_two_turns(tmp_path, warm_policy, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_recipe(RECIPE, [f"output_dir={tmp_path}", "run_name=mt", "env.type=chain_addition",
                               "grpo.max_num_steps=3", "generation.max_tokens=6", "validation.val_at_start=false",
                               "validation.val_at_end=false", "logging.tensorboard=false"])
    parts = build_parts(cfg, warm_policy)
    obs_len = {len(parts.tokenizer.encode(f"+{c:02d}=", add_special_tokens=False)) for c in range(100)}
    ctl = Controller(cfg, parts, tmp_path / "mt", total_steps=3, spool_dir=tmp_path / "mt" / "spool")
    asyncio.run(ctl.run())
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "mt" / "spool").glob("step_*.json"))]
    assert len(records) == 3
    two_turn = 0
    for rec in records:
        for g in rec["groups"]:
            for s in g["samples"]:
                mask = s.get("completion_mask")
                assert mask is not None and len(mask) == len(s["completion_ids"]) == len(s["gen_logprobs"])
                zeros = [i for i, m in enumerate(mask) if m == 0]
                assert all(s["gen_logprobs"][i] == 0.0 for i in zeros)
                if zeros:
                    two_turn += 1
                    assert len(zeros) in obs_len  # exactly one observation between the two turns
                    assert s["token_versions"][zeros[0]] == -1
    assert two_turn > 0, "no episode reached its second turn"
