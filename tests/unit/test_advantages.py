"""GRPO advantages against values written out by hand."""

import math

import pytest
import torch

from rl_core.algorithms.advantages import compute_advantages, grpo_advantages
from rl_core.config.schema import AdvantageConfig


def close(a, b, tol=1e-5):
    return all(abs(x - y) < tol for x, y in zip(a, b, strict=True))


def test_mean_baseline_without_std():
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), "mean", normalize_std=False)
    assert close(adv[0].tolist(), [0.5, -0.5, -0.5, 0.5])


def test_mean_baseline_with_unbiased_std():
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3)
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), "mean", normalize_std=True, eps=0.0)
    s = 0.5 / math.sqrt(1 / 3)
    assert close(adv[0].tolist(), [s, -s, -s, s])


def test_leave_one_out_baseline():
    # b_0 = (0 + 0 + 1) / 3 = 1/3 -> A_0 = 2/3 ; b_1 = (1 + 0 + 1) / 3 = 2/3 -> A_1 = -2/3
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), "leave_one_out", normalize_std=False)
    assert close(adv[0].tolist(), [2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_leave_one_out_uneven_group():
    # rewards [3, 1, 2]: b = [1.5, 2.5, 2.0] -> A = [1.5, -1.5, 0]
    adv = grpo_advantages(torch.tensor([[3.0, 1.0, 2.0]]), "leave_one_out", normalize_std=False)
    assert close(adv[0].tolist(), [1.5, -1.5, 0.0])


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("std", [True, False])
def test_identical_rewards_give_zero(baseline, std):
    adv = grpo_advantages(torch.tensor([[0.7, 0.7, 0.7]]), baseline, normalize_std=std)
    assert adv.abs().max().item() == 0.0


def test_group_of_two_with_std():
    # [1, 0]: mean 0.5, unbiased std sqrt(0.5) -> +-0.5/0.7071 = +-0.7071
    adv = grpo_advantages(torch.tensor([1.0, 0.0]), "mean", normalize_std=True, eps=0.0)
    assert close(adv[0].tolist(), [math.sqrt(0.5), -math.sqrt(0.5)])


def test_several_groups_are_independent():
    adv = grpo_advantages(torch.tensor([[1.0, 0.0], [5.0, 5.0]]), "mean", normalize_std=False)
    assert close(adv.flatten().tolist(), [0.5, -0.5, 0.0, 0.0])


def test_group_of_one_is_rejected():
    with pytest.raises(ValueError, match="at least 2"):
        grpo_advantages(torch.tensor([[1.0]]))


def test_compute_advantages_ragged_groups():
    cfg = AdvantageConfig(baseline="mean", normalize_std=False)
    out = compute_advantages(cfg, [[1.0, 0.0, 0.5], [2.0, 0.0]])
    assert close(out[0], [0.5, -0.5, 0.0]) and close(out[1], [1.0, -1.0])
