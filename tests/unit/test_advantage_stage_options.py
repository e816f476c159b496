"""The train pump's advantage stage hands the new options their inputs: which samples are valid
(environment mask, abort) for `exclude_invalid_from_stats`, and which were truncated plus the
critic's value after the last token for `bootstrap_truncated`. The critic is a fake with fixed
values (this test is about the wiring; the formulas have their own hand-computed tests)."""

import asyncio

import torch

from rl_core.config import validate_dict
from rl_core.controller.advantage_stage import AdvantageStage
from rl_core.types import PromptGroup, Sample


def sample(reward, n, finish="stop", env_mask=False):
    return Sample(prompt_ids=[1, 2], completion_ids=[3] * n, gen_logprobs=[-0.5] * n, reward=reward,
                  finish_reason=finish, start_version=0, end_version=0, env_mask=env_mask)


def group(samples):
    return PromptGroup("g", 0, 0, {}, samples, 0, 0)


class FixedCritic:
    """V = 0 everywhere; the value after each sample's last token is 2.0."""

    def __init__(self):
        self.calls = []

    def values(self, chunk, with_final=False):
        self.calls.append(with_final)
        v = torch.zeros(chunk.input_ids.shape)
        return (v, torch.full((chunk.num_samples,), 2.0)) if with_final else v


def build(cfg, groups, critic=None):
    return asyncio.run(AdvantageStage(cfg, None, critic, pad_id=0).build(groups))


def test_truncated_samples_bootstrap_from_the_critic_final_value():
    cfg = validate_dict({"advantage": {"estimator": "gae", "gamma": 1.0, "lam": 1.0, "whiten": False,
                                       "bootstrap_truncated": True}, "critic": {"enabled": True}})
    critic = FixedCritic()
    stage = build(cfg, [group([sample(1.0, 3, "length"), sample(1.0, 3, "stop")])], critic)
    assert critic.calls == [True]
    # gamma = lam = 1, V = 0: A_t = reward + bootstrap on every token; only the truncated one gets +2
    assert stage.advantages == [[3.0, 1.0]]
    off = validate_dict({"advantage": {"estimator": "gae", "gamma": 1.0, "lam": 1.0, "whiten": False},
                         "critic": {"enabled": True}})
    critic = FixedCritic()
    assert build(off, [group([sample(1.0, 3, "length"), sample(1.0, 3, "stop")])], critic).advantages == [[1.0, 1.0]]
    assert critic.calls == [False]


def test_env_masked_and_aborted_samples_leave_the_group_statistics():
    samples = [sample(1.0, 2), sample(0.0, 2), sample(5.0, 2, env_mask=True), sample(9.0, 2, "abort"), sample(0.0, 2)]
    on = validate_dict({"advantage": {"normalize_std": False, "exclude_invalid_from_stats": True}})
    # valid rewards [1, 0, 0]: mean 1/3
    got = build(on, [group(samples)]).advantages[0]
    want = [2 / 3, -1 / 3, 0.0, 0.0, -1 / 3]
    assert all(abs(a - b) < 1e-6 for a, b in zip(got, want, strict=True)), got
    default = build(validate_dict({"advantage": {"normalize_std": False}}), [group(samples)]).advantages[0]
    assert abs(default[0] - (1.0 - 3.0)) < 1e-6  # default: every sample counts (mean of all five = 3)
