"""The collector's gen-0 threshold while the pumps run grows with the in-flight groups (the
thirteenth round of issue 18 item 3): a young collection mid-step traversed every suspended group
started since the last one (20-55 ms each at 2,000 groups in flight)."""

import asyncio
import gc

import pytest

from rl_core.metrics.gc_pauses import RUN_THRESHOLDS, YOUNG_PER_INFLIGHT_GROUP, run_thresholds


@pytest.fixture
def restore_gc():
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_gen0_grows_with_inflight_groups_and_never_lowers(restore_gc):
    gc.set_threshold(700, 10, 10)
    assert run_thresholds() == (700, 10, 10)
    assert gc.get_threshold() == RUN_THRESHOLDS
    assert run_thresholds(2000) == RUN_THRESHOLDS
    assert gc.get_threshold() == (2000 * YOUNG_PER_INFLIGHT_GROUP,) + RUN_THRESHOLDS[1:]
    gc.set_threshold(10**7, 50, 50)  # higher thresholds set by the user stay
    run_thresholds(2000)
    assert gc.get_threshold() == (10**7, 50, 50)
    gc.set_threshold(700, 10, 10)
    run_thresholds(32)  # small runs: the fixed floor
    assert gc.get_threshold() == RUN_THRESHOLDS


def test_negative_inflight_groups_is_an_error(restore_gc):
    with pytest.raises(ValueError, match="inflight_groups"):
        run_thresholds(-1)


def test_controller_sets_gen0_from_max_inflight_groups_and_restores(tmp_path, restore_gc):
    from tests.helpers.fakes import make_parts
    from rl_core.config import validate_dict
    from rl_core.controller.controller import Controller

    cfg = validate_dict({"grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_num_steps": 2},
                         "async_rl": {"max_inflight_groups": 900},
                         "validation": {"val_at_start": False, "val_at_end": False},
                         "logging": {"tensorboard": False, "jsonl": False, "progress": "off"}})
    ctl = Controller(cfg, make_parts(cfg), tmp_path, total_steps=2)
    seen = []
    ctl.step_observers.append(lambda record: seen.append(gc.get_threshold()))
    gc.set_threshold(700, 10, 10)
    asyncio.run(ctl.run())
    assert seen and all(t[0] == 900 * YOUNG_PER_INFLIGHT_GROUP for t in seen)
    assert gc.get_threshold() == (700, 10, 10)
