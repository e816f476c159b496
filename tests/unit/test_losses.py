"""Policy losses (clipped PG, dual clip, GSPO, REINFORCE), KL estimators and importance weights against hand-computed values."""

import math

import pytest
import torch

from rl_core.algorithms.losses import PolicyGradientLoss, aggregate, importance_weights, kl_penalty, make_loss
from rl_core.config.schema import LossConfig
from rl_core.types import TrainChunk


def chunk(lp_gen, adv, loss_mask, sample_mask=None, prev=None, ref=None):
    B, T = len(lp_gen), len(lp_gen[0])
    return TrainChunk(
        input_ids=torch.zeros(B, T, dtype=torch.long), attention_mask=torch.ones(B, T, dtype=torch.long),
        loss_mask=torch.tensor(loss_mask, dtype=torch.float32), gen_logprobs=torch.tensor(lp_gen),
        advantages=torch.tensor(adv), sample_mask=torch.tensor(sample_mask or [1.0] * B),
        start_versions=torch.zeros(B, dtype=torch.long),
        prev_logprobs=None if prev is None else torch.tensor(prev),
        ref_logprobs=None if ref is None else torch.tensor(ref))


def cfg(**kw):
    base = dict(importance_sampling={"enabled": False})
    base.update(kw)
    return LossConfig(**base)


def test_on_policy_token_level_is_minus_mean_advantage_with_its_gradient():
    # ratio = 1 (prev = current): pg_t = -A_t ; mask keeps 3 tokens: A = [1, 1, -2] -> sum = 0 ... use [1,2,-0.5]
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]])).requires_grad_()
    c = chunk([[0.0] * 3] * 2, [[0.0, 1.0, 2.0], [0.0, -0.5, 0.0]], [[0, 1, 1], [0, 1, 0]])
    out = PolicyGradientLoss(cfg())(lp, c)
    assert out.normalizer == 3.0
    assert out.loss_sum.item() == pytest.approx(-(1.0 + 2.0 - 0.5))
    (out.loss_sum / out.normalizer).backward()
    # d/dlp of -r*A with r = exp(lp - sg(lp)) is -A at r = 1
    expected = torch.tensor([[0.0, -1.0, -2.0], [0.0, 0.5, 0.0]]) / 3.0
    assert torch.allclose(lp.grad, expected, atol=1e-6)


def test_clipping_positive_and_negative_advantages():
    prev = [[0.0, 0.0]]
    lp = torch.tensor([[math.log(1.5), math.log(0.5)]])  # ratios 1.5 and 0.5
    # A=+1 at ratio 1.5: min(1.5, 1.2) = 1.2 -> pg -1.2 ; A=-1 at ratio 0.5: min(-0.5, -0.8) = -0.8 -> pg 0.8
    c = chunk([[0.0, 0.0]], [[1.0, -1.0]], [[1, 1]], prev=prev)
    out = PolicyGradientLoss(cfg())(lp, c)
    assert out.loss_sum.item() == pytest.approx(-1.2 + 0.8, abs=1e-6)
    assert out.metrics["clip_frac"] == (2.0, 2.0)


def test_separate_low_and_high_clip():
    lp = torch.tensor([[math.log(1.5), math.log(0.5)]])
    c = chunk([[0.0, 0.0]], [[1.0, -1.0]], [[1, 1]], prev=[[0.0, 0.0]])
    # eps_high 0.4 -> clip 1.4: min(1.5, 1.4) = 1.4 ; eps_low 0.3 -> 0.7: min(-0.5, -0.7) = -0.7
    out = PolicyGradientLoss(cfg(clip_eps_low=0.3, clip_eps_high=0.4))(lp, c)
    assert out.loss_sum.item() == pytest.approx(-1.4 + 0.7, abs=1e-6)


def test_importance_weight_token_level_truncated():
    lp = torch.tensor([[-1.0, -2.0]])
    gen = [[-1.0 - math.log(3.0), -2.0 + math.log(2.0)]]  # w = 3 (clamped to 2) and 0.5
    c = chunk(gen, [[1.0, 1.0]], [[1, 1]])
    loss = PolicyGradientLoss(cfg(importance_sampling={"enabled": True, "truncation": "tis", "max_ratio": 2.0}))
    out = loss(lp, c)
    assert out.loss_sum.item() == pytest.approx(-(2.0 + 0.5), abs=1e-5)
    assert out.metrics["is_oob_frac"] == (1.0, 2.0)


def test_importance_weight_sequence_level():
    prev = torch.tensor([[0.0, -1.0, -1.0]])
    gen = torch.tensor([[0.0, -1.5, -0.8]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    w, _ = importance_weights(prev, gen, mask, "sequence", "none", 0.0, 10.0)
    assert w[0, 1].item() == pytest.approx(math.exp(0.5 - 0.2), rel=1e-6)
    assert w[0, 2].item() == pytest.approx(math.exp(0.3), rel=1e-6)


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    lr = math.log(0.5)  # log(ref / p)
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(-lr)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * lr * lr)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 - 1 - lr)


def test_kl_term_added_with_coefficient():
    lp = torch.tensor([[math.log(0.5)]])
    c = chunk([[math.log(0.5)]], [[0.0]], [[1]], ref=[[math.log(0.25)]])
    out = PolicyGradientLoss(cfg(kl_coef=0.1, kl_estimator="k3"))(lp, c)
    assert out.loss_sum.item() == pytest.approx(0.1 * (0.5 - 1 - math.log(0.5)), abs=1e-6)


def test_sequence_aggregation():
    per_tok = torch.tensor([[1.0, 3.0, 0.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    s, n = aggregate(per_tok, mask, "sequence")
    assert (s.item(), n) == (2.0 + 4.0, 2.0)  # seq means 2 and 4; the empty sequence is not counted
    s, n = aggregate(per_tok, mask, "token")
    assert (s.item(), n) == (8.0, 3.0)


def test_all_tokens_masked_and_sample_mask():
    lp = torch.zeros(2, 2, requires_grad=True)
    c = chunk([[0.0, 0.0]] * 2, [[1.0, 1.0]] * 2, [[1, 1], [1, 1]], sample_mask=[0.0, 0.0])
    out = PolicyGradientLoss(cfg())(lp, c)
    assert out.normalizer == 0.0 and out.loss_sum.item() == 0.0
    c = chunk([[0.0, 0.0]] * 2, [[1.0, 1.0], [5.0, 5.0]], [[1, 1], [1, 1]], sample_mask=[1.0, 0.0])
    out = PolicyGradientLoss(cfg())(lp, c)
    assert out.normalizer == 2.0 and out.loss_sum.item() == pytest.approx(-2.0)


def test_single_valid_sample_single_token():
    lp = torch.tensor([[0.0, -0.3]])
    c = chunk([[0.0, -0.3]], [[0.0, -2.0]], [[0, 1]])
    out = PolicyGradientLoss(cfg(aggregation="sequence"))(lp, c)
    assert (out.loss_sum.item(), out.normalizer) == (pytest.approx(2.0), 1.0)
    assert out.metrics["gen_logprob_abs_error"] == (0.0, 1.0)


# ---------------------------------------------------------------- dual clip, GSPO, REINFORCE, KL clamps


def test_dual_clip_caps_negative_advantages_only():
    lp = torch.tensor([[math.log(4.0), math.log(4.0)]])  # ratio 4 on both tokens
    c = chunk([[0.0, 0.0]], [[-1.0, 1.0]], [[1, 1]], prev=[[0.0, 0.0]])
    # A=-1: max(-rA, -clip(r)A) = max(4, 1.2) = 4 -> capped at -c*A = 3 ; A=+1: max(-4, -1.2) = -1.2
    out = PolicyGradientLoss(cfg(dual_clip_c=3.0))(lp, c)
    assert out.loss_sum.item() == pytest.approx(3.0 - 1.2, abs=1e-5)
    assert out.metrics["dual_clip_frac"] == (1.0, 2.0)
    out = PolicyGradientLoss(cfg())(lp, c)  # without dual clip the negative-advantage token costs 4
    assert out.loss_sum.item() == pytest.approx(4.0 - 1.2, abs=1e-5)


def test_gspo_sequence_ratio_value_clip_and_gradient():
    # token log-ratios ln 1.21 and 0 -> sequence ratio exp(ln 1.21 / 2) = 1.1 on both valid tokens
    lp = torch.tensor([[0.0, math.log(1.21), 0.0]], requires_grad=True)
    c = chunk([[0.0] * 3], [[0.0, 1.0, 1.0]], [[0, 1, 1]], prev=[[0.0, 0.0, 0.0]])
    loss = PolicyGradientLoss(cfg(ratio_level="sequence", aggregation="sequence"))
    out = loss(lp, c)
    assert (out.loss_sum.item(), out.normalizer) == (pytest.approx(-1.1, abs=1e-6), 1.0)
    out.loss_sum.backward()
    # d(-s)/d lp_t = -s / n_valid = -0.55 on each valid token, 0 on the prompt position
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -0.55, -0.55]]), atol=1e-6)
    out = PolicyGradientLoss(cfg(ratio_level="sequence", aggregation="sequence", clip_eps_high=0.05))(lp.detach(), c)
    assert out.loss_sum.item() == pytest.approx(-1.05, abs=1e-6)  # clipped at 1 + 0.05
    assert out.metrics["clip_frac"] == (2.0, 2.0)


def test_reinforce_loss_and_gradient():
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.9]])).requires_grad_()
    c = chunk([[0.0] * 3], [[2.0, 1.0, 7.0]], [[1, 1, 0]])
    out = make_loss(cfg(type="reinforce"))(lp, c)
    # -A logp = -2 ln 0.5 - 1 ln 0.25 = 4 ln 2 ; gradient -A on valid tokens
    assert out.loss_sum.item() == pytest.approx(4 * math.log(2.0), abs=1e-6)
    out.loss_sum.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-2.0, -1.0, 0.0]]))
    assert "clip_frac" not in out.metrics


def test_kl_input_and_output_clamps():
    lp, ref = torch.tensor([0.0]), torch.tensor([-30.0])
    # log r = -30 -> clamped to -20 ; k3 = e^-20 - 1 + 20 ~ 19 -> output clamp 10
    assert kl_penalty(lp, ref, "k3", 20.0, None).item() == pytest.approx(19.0, abs=1e-6)
    assert kl_penalty(lp, ref, "k3", 20.0, 10.0).item() == 10.0
    assert kl_penalty(lp, ref, "k1", None, None).item() == 30.0
    assert kl_penalty(lp, ref, "k1", 20.0, 10.0).item() == 10.0
    c = chunk([[0.0]], [[0.0]], [[1]], ref=[[-30.0]])
    out = PolicyGradientLoss(cfg(kl_coef=0.5, kl_estimator="k1"))(lp[None], c)  # default clamps 20 / 10
    assert out.loss_sum.item() == pytest.approx(5.0)


def test_kl_needs_reference_logprobs():
    c = chunk([[0.0]], [[0.0]], [[1]])
    with pytest.raises(ValueError, match="reference"):
        PolicyGradientLoss(cfg(kl_coef=0.1))(torch.zeros(1, 1), c)


def test_multi_update_loss_needs_prev_logprobs():
    loss = make_loss(cfg(), multi_update=True)
    assert loss.needs_prev_logprobs and not make_loss(cfg()).needs_prev_logprobs
    with pytest.raises(ValueError, match="prev_logprobs"):
        loss(torch.zeros(1, 2), chunk([[0.0, 0.0]], [[1.0, 1.0]], [[1, 1]]))


def test_icepop_zero_weight_keeps_the_token_in_the_normalizer():
    lp = torch.tensor([[-1.0, -2.0]])
    gen = [[-1.0 - math.log(3.0), -2.0]]  # weights 3 (out of [0.5, 2]) and 1
    c = chunk(gen, [[1.0, 1.0]], [[1, 1]])
    isc = {"enabled": True, "truncation": "icepop", "min_ratio": 0.5, "max_ratio": 2.0}
    out = PolicyGradientLoss(cfg(importance_sampling=isc))(lp, c)
    assert (out.loss_sum.item(), out.normalizer) == (pytest.approx(-1.0), 2.0)
    assert out.metrics["is_weight_min"] == (0.0, 1.0) and out.metrics["is_weight_max"] == (1.0, 1.0)


def test_logprob_error_threshold_masks_a_sequence_out_of_the_normalizer():
    lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    gen = [[-1.0, -1.0], [-1.0 - math.log(3.0), -1.0]]  # errors: row 0 -> 1, row 1 -> (3 + 1) / 2 = 2
    c = chunk(gen, [[1.0, 1.0], [5.0, 5.0]], [[1, 1], [1, 1]])
    isc = {"enabled": False, "max_seq_mult_prob_error": 1.5}
    out = PolicyGradientLoss(cfg(importance_sampling=isc))(lp, c)
    assert (out.loss_sum.item(), out.normalizer) == (pytest.approx(-2.0), 2.0)
    assert out.metrics["seq_masked_by_prob_error_frac"] == (1.0, 2.0)
    assert out.metrics["seq_mult_prob_error_max"] == (pytest.approx(2.0), 1.0)
