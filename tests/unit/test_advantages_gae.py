"""GAE, token rewards and the per-chunk dispatch (KL in the reward, critic values) against hand values."""

import math

import pytest
import torch

from rl_core.algorithms.estimate import estimate_advantages
from rl_core.algorithms.gae import compute_gae, gae_advantages, length_adaptive_lambda, token_rewards
from rl_core.config.schema import AdvantageConfig
from rl_core.types import TrainChunk


def close(a, b, tol=1e-6):
    return all(abs(x - y) < tol for x, y in zip(a, b, strict=True))


def T(x):
    return torch.tensor(x, dtype=torch.float64)


def test_token_rewards_on_last_valid_token_minus_penalty():
    mask = T([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 1]])
    pen = T([[9, 0.1, 0.2, 9], [9, 9, 9, 9], [0.5, 9, 0.0, 0.25]])
    r = token_rewards(T([1.0, 5.0, -1.0]), mask, pen)
    assert close(r[0].tolist(), [0.0, -0.1, 0.8, 0.0])
    assert r[1].tolist() == [0.0] * 4  # no valid token: the reward has nowhere to go
    assert close(r[2].tolist(), [-0.5, 0.0, 0.0, -1.25])


def test_gae_by_hand_with_prompt_position_masked():
    # mask [0, 1, 1, 1], reward 1 on the last token, V = [9 (masked), 0.5, 0.6, 0.8], gamma 1, lam 0.5:
    # t3: delta 1 - 0.8 = 0.2 -> A 0.2 ; t2: delta 0.8 - 0.6 = 0.2 -> 0.2 + 0.5*0.2 = 0.3
    # t1: delta 0.6 - 0.5 = 0.1 -> 0.1 + 0.5*0.3 = 0.25
    mask, rew, val = T([[0, 1, 1, 1]]), T([[0, 0, 0, 1]]), T([[9, 0.5, 0.6, 0.8]])
    assert close(gae_advantages(rew, val, mask, 1.0, 0.5)[0].tolist(), [0.0, 0.25, 0.3, 0.2])
    # lam = 1: A = return - V = [0, 0.5, 0.4, 0.2]; returns = 1 everywhere (reward to go)
    adv, ret = compute_gae(rew, val, mask, gamma=1.0, lam=1.0)
    assert close(adv[0].tolist(), [0.0, 0.5, 0.4, 0.2]) and close(ret[0].tolist(), [0.0, 1.0, 1.0, 1.0])


def test_gae_discount_gives_discounted_returns():
    # gamma 0.9, lam 1: t3 0.2 ; t2 0.9*0.8 - 0.6 + 0.9*0.2 = 0.3 ; t1 0.9*0.6 - 0.5 + 0.9*0.3 = 0.31
    mask, rew, val = T([[0, 1, 1, 1]]), T([[0, 0, 0, 1]]), T([[0, 0.5, 0.6, 0.8]])
    adv, ret = compute_gae(rew, val, mask, gamma=0.9, lam=1.0)
    assert close(adv[0].tolist(), [0.0, 0.31, 0.3, 0.2])
    assert close(ret[0].tolist(), [0.0, 0.81, 0.9, 1.0])


def test_gae_carries_over_a_masked_middle_token_and_all_masked_rows():
    # an environment token at position 2 is masked: V there (7) is never used
    # t3: 1 - 0.5 = 0.5 ; t1: 0 + 0.5 - 0.4 + 0.5 = 0.6 ; t0: 0.4 - 0.2 + 0.6 = 0.8
    mask = T([[1, 1, 0, 1], [0, 0, 0, 0]])
    rew = T([[0, 0, 0, 1], [0, 0, 0, 0]])
    val = T([[0.2, 0.4, 7.0, 0.5], [1, 2, 3, 4]])
    adv, ret = compute_gae(rew, val, mask, gamma=1.0, lam=1.0)
    assert close(adv[0].tolist(), [0.8, 0.6, 0.0, 0.5]) and close(ret[0].tolist(), [1.0, 1.0, 0.0, 1.0])
    assert adv[1].tolist() == [0.0] * 4 and ret[1].tolist() == [0.0] * 4


def test_separate_value_lambda():
    mask, rew, val = T([[0, 1, 1, 1]]), T([[0, 0, 0, 1]]), T([[0, 0.5, 0.6, 0.8]])
    adv, ret = compute_gae(rew, val, mask, gamma=1.0, lam=0.5, value_lam=1.0)
    assert close(adv[0].tolist(), [0.0, 0.25, 0.3, 0.2])  # policy: lam 0.5
    assert close(ret[0].tolist(), [0.0, 1.0, 1.0, 1.0])  # critic targets: lam 1 -> reward to go


def test_length_adaptive_lambda():
    # VAPO: 1 - 1 / (alpha * l): alpha 0.05, l = 100 -> 0.8 ; l = 10 -> 1 - 2 < 0 -> 0 ; l = 0 -> 0
    assert close(length_adaptive_lambda(T([100, 10, 0]), 0.05).tolist(), [0.8, 0.0, 0.0])
    # alpha 2/3 on 3 tokens gives lam 0.5: the hand values of the first GAE test
    mask, rew, val = T([[0, 1, 1, 1]]), T([[0, 0, 0, 1]]), T([[9, 0.5, 0.6, 0.8]])
    adv, _ = compute_gae(rew, val, mask, gamma=1.0, lam=0.95, length_adaptive_alpha=2 / 3)
    assert close(adv[0].tolist(), [0.0, 0.25, 0.3, 0.2])


def chunk(mask, gen, sample_mask=None):
    B, n = len(mask), len(mask[0])
    return TrainChunk(input_ids=torch.zeros(B, n, dtype=torch.long), attention_mask=torch.ones(B, n, dtype=torch.long),
                      loss_mask=torch.tensor(mask, dtype=torch.float32), gen_logprobs=torch.tensor(gen),
                      advantages=torch.zeros(B, n), sample_mask=torch.tensor(sample_mask or [1.0] * B),
                      start_versions=torch.zeros(B, dtype=torch.long))


def test_estimate_grpo_broadcasts_over_completion_tokens_and_counts_masked_samples():
    # the second sample is excluded from the loss (sample_mask 0) but still in the group baseline
    c = chunk([[0, 1, 1], [0, 1, 0], [1, 1, 1]], [[0.0] * 3] * 3, sample_mask=[1.0, 0.0, 1.0])
    est = estimate_advantages(AdvantageConfig(normalize_std=False), c, [1.0, 0.0, 0.5], [2, 1])
    assert close(est.sample_advantages.tolist(), [0.5, -0.5, 0.0])
    assert est.advantages.tolist() == [[0.0, 0.5, 0.5], [0.0, -0.5, 0.0], [0.0, 0.0, 0.0]]
    assert est.returns is None
    with pytest.raises(ValueError, match="group_sizes"):
        estimate_advantages(AdvantageConfig(), c, [1.0, 0.0, 0.5], [2, 2])


def test_estimate_kl_in_reward_sequence_level():
    # k1 = gen - ref per token: sample 0 [0, 0, 1], sample 1 [0, 0, 0]; coef 0.5 -> reward 1 - 0.5, 1 - 0
    gen = [[0.0, -1.0, -1.0], [0.0, -1.0, -2.0]]
    ref = torch.tensor([[0.0, -1.0, -2.0], [0.0, -1.0, -2.0]])
    c = chunk([[0, 1, 1], [0, 1, 1]], gen)
    cfg = AdvantageConfig(normalize_std=False, kl_in_reward_coef=0.5)
    est = estimate_advantages(cfg, c, [1.0, 1.0], [2], ref_logprobs=ref)
    assert close(est.sample_advantages.tolist(), [-0.25, 0.25])
    assert est.metrics["kl_in_reward"] == (1.0, 4.0)
    with pytest.raises(ValueError, match="reference"):
        estimate_advantages(cfg, c, [1.0, 1.0], [2])


def test_estimate_reinforce_pp_token_level_kl_return_to_go():
    # penalties coef * k1: sample 0 [0, 0.2, 0.5], sample 1 [0, 0, 0]; rewards [1, 0] - mean -> [0.5, -0.5]
    # kl to go, sample 0: positions 1, 2 -> 0.7, 0.5 ; A = [0, 0.5 - 0.7, 0.5 - 0.5] ; sample 1: -0.5
    gen = [[0.0, -1.0, -1.0], [0.0, -1.0, -2.0]]
    ref = torch.tensor([[0.0, -1.4, -2.0], [0.0, -1.0, -2.0]])
    c = chunk([[0, 1, 1], [0, 1, 1]], gen)
    cfg = AdvantageConfig(estimator="reinforce_pp", whiten=False, kl_in_reward_coef=0.5, kl_in_reward_level="token")
    est = estimate_advantages(cfg, c, [1.0, 0.0], [2], ref_logprobs=ref)
    assert est.sample_advantages is None
    assert close(est.advantages[0].tolist(), [0.0, -0.2, 0.0]) and close(est.advantages[1].tolist(), [0.0, -0.5, -0.5])
    # whitened over the four valid tokens [-0.2, 0, -0.5, -0.5]: mean -0.3, deviations [0.1, 0.3, -0.2, -0.2],
    # unbiased std sqrt(0.18 / 3) = sqrt(0.06)
    cfg = AdvantageConfig(estimator="reinforce_pp", std_eps=1e-12, kl_in_reward_coef=0.5, kl_in_reward_level="token")
    est = estimate_advantages(cfg, c, [1.0, 0.0], [2], ref_logprobs=ref)
    s = math.sqrt(0.06)
    assert close(est.advantages.flatten().tolist(), [0.0, 0.1 / s, 0.3 / s, 0.0, -0.2 / s, -0.2 / s], tol=1e-5)


def test_estimate_gae_uses_values_and_returns_targets():
    c = chunk([[0, 1, 1, 1]], [[0.0] * 4])
    cfg = AdvantageConfig(estimator="gae", gamma=1.0, lam=0.5, value_lam=1.0, whiten=False)
    values = torch.tensor([[9.0, 0.5, 0.6, 0.8]])
    est = estimate_advantages(cfg, c, [1.0], [1], values=values)
    assert close(est.advantages[0].tolist(), [0.0, 0.25, 0.3, 0.2])
    assert close(est.returns[0].tolist(), [0.0, 1.0, 1.0, 1.0])
    assert est.metrics["value_mean"] == pytest.approx((1.9, 3.0))
    with pytest.raises(ValueError, match="critic"):
        estimate_advantages(cfg, c, [1.0], [1])
    # whitened over the valid tokens [0.25, 0.3, 0.2]: mean 0.25, std 0.05
    est = estimate_advantages(cfg.model_copy(update={"whiten": True, "std_eps": 1e-12}), c, [1.0], [1], values=values)
    assert close(est.advantages[0].tolist(), [0.0, 0.0, 1.0, -1.0], tol=1e-5)


def test_estimate_gae_with_token_kl_penalty():
    # penalty 0.5 * k1 = [0, 0.1, 0] on positions 1-2; reward 1 at position 2; V = 0, gamma = lam = 1
    # token rewards [0, -0.1, 1] -> A = returns = [0, 0.9, 1.0]
    gen = [[0.0, -1.0, -1.0]]
    ref = torch.tensor([[0.0, -1.2, -1.0]])
    cfg = AdvantageConfig(estimator="gae", lam=1.0, whiten=False, kl_in_reward_coef=0.5, kl_in_reward_level="token")
    est = estimate_advantages(cfg, chunk([[0, 1, 1]], gen), [1.0], [1], ref_logprobs=ref, values=torch.zeros(1, 3))
    assert close(est.advantages[0].tolist(), [0.0, 0.9, 1.0]) and close(est.returns[0].tolist(), [0.0, 0.9, 1.0])
    assert math.isclose(est.metrics["kl_in_reward"][0], 0.2, abs_tol=1e-6)
