"""A few asynchronous GRPO steps of the tiny MoE recipe with router replay, through the
controller: the native engine records every token's routes, they travel with the samples
into the trainer, which replays them (no token backfilled) and agrees with generation."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-addition-moe.yaml"


def test_moe_recipe_trains_with_router_replay(tmp_path, monkeypatch):
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import train_from_recipe
    from rl_core.metrics.logger import read_jsonl

    monkeypatch.chdir(ROOT)
    # a short warm-up (30 steps, whatever the accuracy): this test is about the plumbing, not learning
    cfg = load_recipe(RECIPE, [f"output_dir={tmp_path}", "run_name=moe", "logging.tensorboard=false",
                               "grpo.max_num_steps=3", "model.warmup.target_accuracy=0.0",
                               "model.warmup.eval_every_steps=30", "model.warmup.num_eval_prompts=8",
                               "validation.val_at_start=false", "validation.val_at_end=false"])
    assert cfg.model.tiny.architecture == "mixtral" and cfg.trainer.router_replay.enabled
    train_from_recipe(cfg)
    rows = read_jsonl(tmp_path / "moe" / "metrics.jsonl", kind="train")
    assert len(rows) == 3
    for row in rows:
        assert row["train/router_replay_backfill_frac"] == 0.0  # the native engine recorded every route
        assert row["train/num_tokens"] > 0
    # step 1 is on-policy and fp32 on both sides: with replayed routes, logprobs agree to rounding
    assert rows[0]["train/gen_logprob_abs_error"] < 1e-3
