"""From recorded timestamps: in asynchronous mode generation for step k+1 runs while step
k trains; in synchronous mode it never does."""

from __future__ import annotations

from rl_core.controller.events import Timeline


def _overlaps(spans):
    gen = [s for s in spans if s.kind == "generate"]
    train = {s.step: s for s in spans if s.kind == "train"}
    hits = 0
    for g in gen:
        t = train.get(g.step - 1)  # generation for step k+1 vs training of step k
        if t is not None and g.start < t.end and t.start < g.end:
            hits += 1
    return hits, len(gen), len(train)


COMMON = ("grpo.max_num_steps=12", "validation.val_at_start=false", "validation.val_at_end=false")


def test_async_generation_overlaps_training(run_recipe):
    _, run_dir = run_recipe(*COMMON, "async_rl.sampler.max_lookahead_versions=1", name="async")
    hits, ngen, ntrain = _overlaps(Timeline.read(run_dir / "timeline.jsonl"))
    assert ntrain == 12 and ngen == 12 * 16
    assert hits > 0, "no generation for step k+1 overlapped the training of step k"


def test_sync_generation_never_overlaps_training_of_previous_step(run_recipe):
    _, run_dir = run_recipe(*COMMON, "async_rl.sampler.max_lookahead_versions=0", name="sync")
    spans = Timeline.read(run_dir / "timeline.jsonl")
    hits, ngen, ntrain = _overlaps(spans)
    assert ntrain == 12 and ngen == 12 * 16
    assert hits == 0
    # stronger: every generation for step k starts after step k-1's refit has ended
    refit = {s.step: s for s in spans if s.kind == "refit"}
    for g in (s for s in spans if s.kind == "generate" and s.step > 0):
        assert g.start >= refit[g.step - 1].end
