"""trainer.lr_schedule: the rate of each RL step, against hand-computed values, and the
torch trainer applying it from its weight version (so a resumed run continues it)."""

from __future__ import annotations

import math

import pytest

from rl_core.algorithms.losses import make_loss
from rl_core.config import validate_dict
from rl_core.train.torch_trainer import TorchTrainer
from rl_core.train.update import scheduled_lr
from tests.helpers.trainers import tiny_hf_dir


def _trainer_cfg(**sched):
    return validate_dict({"trainer": {"lr": 1e-3, "lr_schedule": sched}}).trainer


def test_constant_is_the_recipe_rate_at_every_step():
    cfg = _trainer_cfg()
    assert [scheduled_lr(cfg, k, 10) for k in (0, 5, 9, 50)] == [1e-3] * 4


def test_linear_decays_to_the_floor_at_the_last_step():
    cfg = _trainer_cfg(type="linear", min_lr_ratio=0.1)
    # progress k / 10; rate = lr * (0.1 + 0.9 * (1 - k / 10))
    assert scheduled_lr(cfg, 0, 10) == pytest.approx(1e-3)
    assert scheduled_lr(cfg, 5, 10) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert scheduled_lr(cfg, 10, 10) == pytest.approx(1e-4)
    assert scheduled_lr(cfg, 12, 10) == pytest.approx(1e-4)  # past the horizon (a branch run): the floor


def test_cosine_with_warmup():
    cfg = _trainer_cfg(type="cosine", warmup_steps=4)
    assert [scheduled_lr(cfg, k, 14) for k in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    # after the warm-up: progress (k - 4) / 10 along a half cosine down to 0
    assert scheduled_lr(cfg, 4, 14) == pytest.approx(1e-3)
    assert scheduled_lr(cfg, 9, 14) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert scheduled_lr(cfg, 14, 14) == pytest.approx(0.0, abs=1e-12)


def test_a_field_out_of_range_is_refused():
    with pytest.raises(Exception, match=r"min_lr_ratio"):
        _trainer_cfg(type="linear", min_lr_ratio=1.5)


def test_the_torch_trainer_takes_the_rate_of_its_weight_version(tmp_path):
    model = tiny_hf_dir(tmp_path / "m")
    cfg = validate_dict({"trainer": {"lr": 1e-3, "lr_schedule": {"type": "linear"}}})
    trainer = TorchTrainer(model, cfg.trainer, lr_total_steps=10)
    loss = make_loss(cfg.loss)
    for version, want in ((0, 1e-3), (4, 6e-4), (9, 1e-4)):
        trainer.version = version  # what a resumed run's trainer state restores
        trainer.begin(loss)
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(want)
        trainer.abort()


@pytest.mark.parametrize("backend, nproc", [("fsdp2", 2), ("megatron", 1)])
def test_data_parallel_trainers_follow_the_schedule_as_the_torch_trainer(backend, nproc, tmp_path):
    """Two RL steps of a linear schedule over grpo.max_num_steps 2 (rates lr and lr / 2) give
    the torch trainer's steps and weights (the cross-backend tolerances of test_fsdp_step)."""
    from tests.helpers.trainers import assert_same_step, max_weight_diff, run_check

    model = tiny_hf_dir(tmp_path / "m")
    sets = ("trainer.lr=1e-3", "trainer.lr_schedule.type=linear", "grpo.max_num_steps=2")
    ref, w_ref = run_check(model, tmp_path, "torch", 1, *sets)
    got, w_got = run_check(model, tmp_path, backend, nproc, *sets)
    assert [s["lr"] for s in ref["steps"]] == pytest.approx([1e-3, 5e-4])
    assert [s["lr"] for s in got["steps"]] == pytest.approx([1e-3, 5e-4])
    assert_same_step(ref, got, 1e-5)
    assert max_weight_diff(w_ref, w_got) < 1e-4
