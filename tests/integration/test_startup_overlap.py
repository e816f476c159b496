"""Start-up overlap: the generation backend sets up (loads its weights) while the trainer
builds its model. Asserted from the logged timestamps (timeline `setup_*` spans and the
`timing/setup/*` record), never from a timing threshold."""

from __future__ import annotations

from rl_core.controller.events import Timeline
from rl_core.metrics.logger import read_jsonl


def test_generation_and_trainer_setups_overlap(run_recipe, capsys):
    _, run_dir = run_recipe("grpo.max_num_steps=2", "validation.val_at_start=false", "validation.val_at_end=false",
                            name="overlap")
    spans = {s.kind: s for s in Timeline.read(run_dir / "timeline.jsonl") if s.kind.startswith("setup_")}
    gen, trainer = spans["setup_generation"], spans["setup_trainer"]
    assert gen.start < trainer.end and trainer.start < gen.end, "the two set-ups ran one after the other"
    first = min(s.start for s in Timeline.read(run_dir / "timeline.jsonl") if not s.kind.startswith("setup_"))
    assert max(gen.end, trainer.end) <= first + 1e-3 and gen.end < 0, "set-up spans are on the run's clock, before it"

    (setup,) = read_jsonl(run_dir / "metrics.jsonl", kind="setup")
    parts = setup["timing/setup/generation_s"] + setup["timing/setup/trainer_s"]
    assert abs(setup["timing/setup/sum_s"] - parts) < 1e-6
    assert setup["timing/setup/overlap_s"] > 0
    # the whole set-up spans both parts (their union, plus a little bookkeeping around them),
    # and, because they overlapped, less than their sum (no timing threshold: the structure)
    assert setup["timing/setup/total_s"] >= parts - setup["timing/setup/overlap_s"] - 1e-6
    assert setup["timing/setup/total_s"] < parts
    assert max(setup["timing/setup/generation_s"], setup["timing/setup/trainer_s"]) <= setup["timing/setup/total_s"]
    assert "[setup] " in capsys.readouterr().out
