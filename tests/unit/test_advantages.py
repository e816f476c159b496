"""Sequence-level advantage estimators (GRPO, GDPO, REINFORCE++, raw reward) against values written out by hand."""

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


def test_group_of_one_gets_zero():
    # nothing to compare a lone sample with: 0, as in the ragged (training) path
    assert grpo_advantages(torch.tensor([[1.0], [4.0]])).tolist() == [[0.0], [0.0]]


def test_compute_advantages_ragged_groups():
    cfg = AdvantageConfig(baseline="mean", normalize_std=False)
    out = compute_advantages(cfg, [[1.0, 0.0, 0.5], [2.0, 0.0]])
    assert close(out[0], [0.5, -0.5, 0.0]) and close(out[1], [1.0, -1.0])


# ---------------------------------------------------------------- ragged groups (group ids)

from rl_core.algorithms.advantages import (check_reward_weights, gdpo_advantages, group_ids_from_sizes,  # noqa: E402
                                           group_normalized, raw_reward_advantages, reinforce_pp_advantages,
                                           whiten)
from rl_core.errors import RecipeError  # noqa: E402


def test_group_ids_from_sizes():
    assert group_ids_from_sizes([2, 3, 1]).tolist() == [0, 0, 1, 1, 1, 2]


def test_group_normalized_ragged_matches_hand_values():
    # group 0: [1, 0, 0] mean 1/3, unbiased std sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3)
    # group 1: [2, 4]: mean 3, unbiased std sqrt(2)
    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0])
    gid = group_ids_from_sizes([3, 2])
    a = group_normalized(r, gid, "mean", normalize_std=True, eps=0.0)
    s0, s1 = math.sqrt(1 / 3), math.sqrt(2)
    assert close(a.tolist(), [(2 / 3) / s0, (-1 / 3) / s0, (-1 / 3) / s0, -1 / s1, 1 / s1])
    # leave-one-out without std: group 0 b = [0, 0.5, 0.5], group 1 b = [4, 2]
    a = group_normalized(r, gid, "leave_one_out", normalize_std=False)
    assert close(a.tolist(), [1.0, -0.5, -0.5, -2.0, 2.0])


def test_group_normalized_single_sample_and_identical_groups_are_zero():
    r = torch.tensor([5.0, 0.3, 0.3, 0.3, 1.0, 0.0])
    gid = group_ids_from_sizes([1, 3, 2])  # a single valid sample, an identical group, a normal group
    a = group_normalized(r, gid, "leave_one_out", normalize_std=True, eps=0.0)
    assert a[:4].abs().max().item() == 0.0
    # [1, 0] leave-one-out: b = [0, 1] -> [1, -1]; unbiased std sqrt(0.5)
    assert close(a[4:].tolist(), [1.0 / math.sqrt(0.5), -1.0 / math.sqrt(0.5)])


def test_whiten_by_hand_and_edge_cases():
    assert close(whiten(torch.tensor([2.0, 0.0, 1.0]), eps=0.0).tolist(), [1.0, -1.0, 0.0])
    # masked: only [3, 1] count (mean 2, std sqrt(2)); masked positions become 0
    w = whiten(torch.tensor([3.0, 100.0, 1.0]), torch.tensor([1.0, 0.0, 1.0]), eps=0.0)
    assert close(w.tolist(), [1 / math.sqrt(2), 0.0, -1 / math.sqrt(2)])
    assert whiten(torch.tensor([4.0, 4.0])).tolist() == [0.0, 0.0]  # zero spread: only centred
    assert whiten(torch.tensor([7.0])).tolist() == [0.0]  # one element
    assert whiten(torch.tensor([1.0, 2.0]), torch.zeros(2)).tolist() == [0.0, 0.0]  # all masked


def test_gdpo_by_hand():
    # one group of 3; correct [1, 0, 0] -> mean-centred [2/3, -1/3, -1/3];
    # format [1, 1, 0] -> [1/3, 1/3, -2/3]; weights 1 and 0.5 -> [5/6, -1/6, -2/3];
    # batch whitening: mean 0, unbiased std sqrt((25 + 1 + 16) / 36 / 2) = sqrt(7/12)
    comps = {"correct": torch.tensor([1.0, 0.0, 0.0]), "format": torch.tensor([1.0, 1.0, 0.0])}
    a = gdpo_advantages(comps, group_ids_from_sizes([3]), {"correct": 1.0, "format": 0.5}, "mean",
                        normalize_std=False, eps=0.0)
    s = math.sqrt(7 / 12)
    assert close(a.tolist(), [5 / 6 / s, -1 / 6 / s, -2 / 3 / s])


def test_gdpo_keeps_a_signal_that_grpo_on_the_sum_loses():
    # two groups of 2. Group 0: (correct, format) = (1, 0) and (0, 1): equal sums, so GRPO on the
    # sum gives 0, and so does GDPO (each component gives +-x, weights equal -> 0).
    # Group 1: (1, 1) and (0, 1): format constant (0), correct +-1/sqrt(0.5) with std
    comps = {"correct": torch.tensor([1.0, 0.0, 1.0, 0.0]), "format": torch.tensor([0.0, 1.0, 1.0, 1.0])}
    a = gdpo_advantages(comps, group_ids_from_sizes([2, 2]), None, "mean", normalize_std=True, eps=0.0)
    # before whitening: [0, 0, c, -c] with c = 0.5 / sqrt(0.5); whitened: mean 0, std = c * sqrt(2/3)
    c = 0.5 / math.sqrt(0.5)
    std = math.sqrt(2 * c * c / 3)
    assert close(a.tolist(), [0.0, 0.0, c / std, -c / std])


def test_gdpo_unknown_weight_and_identical_everything():
    comps = {"correct": torch.tensor([1.0, 1.0])}
    with pytest.raises(KeyError, match="format"):
        gdpo_advantages(comps, group_ids_from_sizes([2]), {"format": 1.0})
    assert gdpo_advantages(comps, group_ids_from_sizes([2])).tolist() == [0.0, 0.0]


def test_reinforce_pp_by_hand():
    # groups [1, 0] and [1, 1]: minus group mean -> [0.5, -0.5, 0, 0]; whitened: std sqrt(0.5 / 3)
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    gid = group_ids_from_sizes([2, 2])
    a = reinforce_pp_advantages(r, gid, subtract_group_mean=True, whiten_batch=True, eps=0.0)
    k = 0.5 / math.sqrt(0.5 / 3)
    assert close(a.tolist(), [k, -k, 0.0, 0.0])
    # without the group baseline: [1, 0, 1, 1] mean 0.75, std sqrt(0.75 / 3) = 0.5
    a = reinforce_pp_advantages(r, gid, subtract_group_mean=False, whiten_batch=True, eps=0.0)
    assert close(a.tolist(), [0.5, -1.5, 0.5, 0.5])
    a = reinforce_pp_advantages(r, gid, subtract_group_mean=True, whiten_batch=False)
    assert close(a.tolist(), [0.5, -0.5, 0.0, 0.0])


def test_raw_reward():
    r = torch.tensor([2.0, 0.0, 1.0])
    assert close(raw_reward_advantages(r).tolist(), [2.0, 0.0, 1.0])
    assert close(raw_reward_advantages(r, whiten_batch=True, eps=0.0).tolist(), [1.0, -1.0, 0.0])


def test_compute_advantages_dispatches_new_estimators():
    groups = [[1.0, 0.0], [1.0, 1.0]]
    out = compute_advantages(AdvantageConfig(estimator="reinforce_pp", whiten=False), groups)
    assert close(out[0], [0.5, -0.5]) and close(out[1], [0.0, 0.0])
    out = compute_advantages(AdvantageConfig(estimator="raw_reward", whiten=False), [[3.0, 1.0], [2.0]])
    assert close(out[0], [3.0, 1.0]) and close(out[1], [2.0])
    comps = [[{"a": 1.0, "b": 0.0}, {"a": 0.0, "b": 0.0}], [{"a": 0.0, "b": 1.0}, {"a": 0.0, "b": 0.0}]]
    out = compute_advantages(AdvantageConfig(estimator="gdpo", normalize_std=False), groups, comps)
    # per group each component gives [+0.5, -0.5]; whitened over [0.5, -0.5, 0.5, -0.5] (std sqrt(1/3))
    k = 0.5 / math.sqrt(1 / 3)
    assert close(out[0], [k, -k], tol=1e-4) and close(out[1], [k, -k], tol=1e-4)
    with pytest.raises(ValueError, match="named reward components"):
        compute_advantages(AdvantageConfig(estimator="gdpo"), groups)
    with pytest.raises(ValueError, match="same named rewards"):
        compute_advantages(AdvantageConfig(estimator="gdpo"), [[1.0, 0.0]], [[{"a": 1.0}, {"b": 0.0}]])


def test_check_reward_weights_names_the_field():
    check_reward_weights(AdvantageConfig(estimator="gdpo", reward_weights={"correct": 1.0}), ["correct", "format"])
    with pytest.raises(RecipeError, match="advantage.reward_weights") as err:
        check_reward_weights(AdvantageConfig(estimator="gdpo", reward_weights={"corect": 1.0}), ["correct", "format"])
    assert "corect" in str(err.value) and "Fix:" in str(err.value)
