"""Reward shaping and filtering (DAPO overlong penalty, scaling, overlong filtering, dynamic-sampling predicate)."""

import pytest
import torch

from rl_core.algorithms.shaping import (dropped_groups_budget, dynamic_sampling_filter, is_zero_variance_group,
                                        overlong_penalty, overlong_window, scale_rewards, shape_group)
from rl_core.config.schema import DynamicSamplingConfig, OverlongPenaltyConfig, RewardShapingConfig
from rl_core.types import PromptGroup, Sample


def close(a, b, tol=1e-9):
    return all(abs(x - y) < tol for x, y in zip(a, b, strict=True))


def sample(reward, n_tokens, finish="stop", rewards=None, env_mask=False):
    return Sample(prompt_ids=[1, 2], completion_ids=list(range(n_tokens)), gen_logprobs=[-0.1] * n_tokens,
                  reward=reward, finish_reason=finish, start_version=0, end_version=0,
                  rewards=dict(rewards or {}), env_mask=env_mask)


def test_overlong_penalty_by_hand():
    # L_max 20, L_cache 4: free up to 16, ramp (16 - l) / 4 up to 20, -1 beyond
    p = overlong_penalty([10, 16, 18, 20, 25], 20, 4)
    assert close(p.tolist(), [0.0, 0.0, -0.5, -1.0, -1.0])
    assert close(overlong_penalty([17], 20, 4, penalty=2.0).tolist(), [-0.5])
    with pytest.raises(ValueError, match="buffer_tokens"):
        overlong_penalty([1], 4, 4)


def test_overlong_window_defaults():
    assert overlong_window(OverlongPenaltyConfig(), 20) == (20, 4)
    assert overlong_window(OverlongPenaltyConfig(max_response_tokens=10, buffer_tokens=3), 20) == (10, 3)


def test_scale_rewards_clamps_then_maps():
    r = scale_rewards([-1.0, 0.0, 0.5, 1.0, 3.0], 0.0, 1.0, -1.0, 1.0)
    assert close(r.tolist(), [-1.0, -1.0, 0.0, 1.0, 1.0])
    assert close(scale_rewards([0.25], 0.0, 0.5, 10.0, 20.0).tolist(), [15.0])
    with pytest.raises(ValueError):
        scale_rewards([0.0], 1.0, 1.0, 0.0, 1.0)


def test_shape_group_applies_scaling_penalty_and_filtering():
    cfg = RewardShapingConfig(overlong_filtering=True,
                              overlong_penalty={"enabled": True, "max_response_tokens": 8, "buffer_tokens": 4},
                              scaling={"enabled": True, "source_min": 0.0, "source_max": 1.0,
                                       "target_min": -1.0, "target_max": 1.0})
    group = [sample(1.0, 3, rewards={"correct": 1.0}), sample(0.0, 6, rewards={"correct": 0.0}),
             sample(1.0, 8, finish="length", rewards={"correct": 1.0})]
    out = shape_group(cfg, group, generation_max_tokens=8)
    # scaled [1, -1, 1]; penalties (l <= 4 free, (4 - l) / 4): [0, -0.5, -1]
    assert close([s.reward for s in out.samples], [1.0, -1.5, 0.0])
    assert [s.env_mask for s in out.samples] == [False, False, True]
    assert [s.info["unshaped_reward"] for s in out.samples] == [1.0, 0.0, 1.0]
    assert [s.rewards["overlong_penalty"] for s in out.samples] == [0.0, -0.5, -1.0]
    assert out.samples[2].info["overlong_filtered"] and out.samples[0].rewards["correct"] == 1.0
    m = out.metrics
    assert m["overlong_filtered_frac"] == (1.0, 3.0) and m["overlong_penalized_frac"] == (2.0, 3.0)
    assert m["overlong_penalty_mean"] == (-1.5, 3.0) and m["reward_unshaped_mean"] == (2.0, 3.0)
    assert m["reward_shaped_mean"] == (pytest.approx(-0.5), 3.0)
    # the input samples are untouched
    assert [s.reward for s in group] == [1.0, 0.0, 1.0] and not group[2].env_mask and "unshaped_reward" not in group[0].info


def test_shape_group_with_everything_off_is_identity():
    group = [sample(0.5, 3), sample(0.0, 8, finish="length", env_mask=True)]
    out = shape_group(RewardShapingConfig(), group, generation_max_tokens=8)
    assert [s.reward for s in out.samples] == [0.5, 0.0] and [s.env_mask for s in out.samples] == [False, True]
    assert set(out.metrics) == {"reward_unshaped_mean", "reward_shaped_mean"}


def test_zero_variance_uses_the_unshaped_reward():
    cfg = RewardShapingConfig(overlong_penalty={"enabled": True, "max_response_tokens": 8, "buffer_tokens": 4})
    shaped = shape_group(cfg, [sample(1.0, 2), sample(1.0, 8)], generation_max_tokens=8).samples
    assert [s.reward for s in shaped] == [1.0, 0.0]  # shaped rewards differ ...
    assert is_zero_variance_group(shaped)  # ... but every answer was correct: no signal
    assert not is_zero_variance_group([sample(1.0, 2), sample(0.0, 2)])
    assert is_zero_variance_group([sample(0.3, 2)])  # a single sample has no variance


def test_zero_variance_on_components_for_gdpo():
    a = sample(1.0, 2, rewards={"correct": 1.0, "format": 0.0})
    b = sample(1.0, 2, rewards={"correct": 0.0, "format": 1.0})
    assert is_zero_variance_group([a, b])  # equal totals
    assert not is_zero_variance_group([a, b], use_components=True)  # but each component varies
    assert is_zero_variance_group([a, a], use_components=True)


def test_dynamic_sampling_filter_and_budget():
    def group(rewards):
        return PromptGroup(group_id="g", prompt_index=0, epoch=0, example={}, start_version=0, end_version=0,
                           samples=[sample(r, 2) for r in rewards])

    keep, m = dynamic_sampling_filter([group([1, 1]), group([1, 0]), group([0, 0]), group([1, 1, 1])])
    assert keep == [False, True, False, False]
    assert m["zero_variance_frac"] == (3.0, 4.0)
    assert m["zero_variance_reward_mean"] == (2.0, 3.0)  # group means 1, 0, 1: mostly too easy
    assert dropped_groups_budget(DynamicSamplingConfig(), 16) == 160
    assert dropped_groups_budget(DynamicSamplingConfig(max_num_dropped_groups_per_step=5), 16) == 5


def test_penalty_is_a_tensor_of_float64():
    assert overlong_penalty(torch.tensor([5]), 8, 4).dtype == torch.float64
