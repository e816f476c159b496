"""The garbage-collector policy of long-lived processes (rl_core.metrics.gc_pauses): frozen
setup objects are not collected until unfrozen, the clock measures collections and resets on
read, and the controller reports timing/gc_* in every step's metrics and leaves nothing frozen."""

from __future__ import annotations

import asyncio
import gc
import weakref

from tests.helpers.fakes import make_parts
from rl_core.config import validate_dict
from rl_core.controller.controller import Controller
from rl_core.metrics.gc_pauses import GcClock, freeze_setup_objects, unfreeze


class Node:
    def __init__(self):
        self.other = self  # a reference cycle: only the collector frees it


def test_frozen_cycles_wait_for_unfreeze():
    node = Node()
    ref = weakref.ref(node)
    try:
        assert freeze_setup_objects() > 0
        del node
        gc.collect()
        assert ref() is not None  # frozen: the full collection did not scan it
    finally:
        unfreeze()
    gc.collect()
    assert ref() is None
    assert gc.get_freeze_count() == 0


def test_clock_measures_collections_and_resets():
    clock = GcClock().start()
    try:
        clock.take()
        garbage = [Node() for _ in range(20_000)]
        del garbage
        gc.collect()
        first = clock.take()
        assert first["gc_full_collections"] >= 1
        assert 0 < first["gc_max_pause_s"] <= first["gc_s"]
        assert clock.take() == {"gc_s": 0.0, "gc_max_pause_s": 0.0, "gc_full_collections": 0.0}
    finally:
        clock.stop()
    gc.collect()
    assert clock.take()["gc_full_collections"] == 0  # stopped: no longer called


def test_controller_reports_gc_time_per_step_and_unfreezes(tmp_path):
    cfg = validate_dict({"grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 2, "max_num_steps": 3},
                         "validation": {"val_at_start": False, "val_at_end": False},
                         "logging": {"tensorboard": False, "jsonl": False, "progress": "off"}})
    rows = []
    ctl = Controller(cfg, make_parts(cfg), tmp_path, total_steps=3)
    ctl.step_observers.append(lambda record: rows.append(dict(record.metrics)))
    asyncio.run(ctl.run())
    assert len(rows) == 3
    for row in rows:
        assert row["timing/gc_s"] >= row["timing/gc_max_pause_s"] >= 0.0 and row["timing/gc_full_collections"] >= 0
    assert gc.get_freeze_count() == 0
    assert ctl.train.gc_clock._callback not in gc.callbacks
