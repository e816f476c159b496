"""The algorithm options users of other systems expect, each against hand-computed values or a
brute-force reference written here (Python's `statistics` on plain lists), never against the
code under test: leave-one-out std of the other samples, the validity mask of the group
statistics, GAE bootstrapped at truncation, the unsaturated DAPO overlong penalty, empty
sequences counted as 0 in sequence aggregation; plus the one-sample group (0, not an error)
and the dual-clip guard."""

import math
import statistics

import pytest
import torch

from rl_core.algorithms.advantages import compute_advantages, grpo_advantages, group_normalized
from rl_core.algorithms.estimate import estimate_advantages
from rl_core.algorithms.losses import PolicyGradientLoss, aggregate, clipped_pg_terms
from rl_core.algorithms.shaping import overlong_penalty, shape_group
from rl_core.config import validate_dict
from rl_core.config.schema import AdvantageConfig, LossConfig, RewardShapingConfig
from rl_core.types import Sample, TrainChunk
from test_losses_config import bad  # a refused recipe names the field, the value and the fix


def close(a, b, tol=1e-9):
    return all(abs(x - y) < tol for x, y in zip(a, b, strict=True))


def chunk(mask, sample_mask=None, adv=None):
    B, n = len(mask), len(mask[0])
    return TrainChunk(input_ids=torch.zeros(B, n, dtype=torch.long), attention_mask=torch.ones(B, n, dtype=torch.long),
                      loss_mask=torch.tensor(mask, dtype=torch.float32), gen_logprobs=torch.zeros(B, n),
                      advantages=torch.zeros(B, n) if adv is None else torch.tensor(adv),
                      sample_mask=torch.tensor(sample_mask or [1.0] * B),
                      start_versions=torch.zeros(B, dtype=torch.long))


# ---------------------------------------------------------------- leave-one-out std of the other samples


def loo_reference(group: list[float]) -> list[float]:
    """(r_i - mean(others)) / stdev(others); only centred where the others have no spread."""
    out = []
    for i, r in enumerate(group):
        others = group[:i] + group[i + 1:]
        b = statistics.fmean(others)
        s = statistics.stdev(others) if len(others) >= 2 else 0.0
        out.append(r - b if s == 0 else (r - b) / s)
    return out


def test_leave_one_out_std_by_hand():
    # [3, 1, 2, 6]: sample 0's others [1, 2, 6]: mean 3 -> 0; sample 1's others [3, 2, 6]: mean 11/3,
    # squared deviations (4 + 25 + 49) / 9 = 26/3 -> var 13/3 -> A = (1 - 11/3) / sqrt(13/3)
    a = group_normalized(torch.tensor([3.0, 1.0, 2.0, 6.0]), torch.zeros(4, dtype=torch.long), "leave_one_out",
                         eps=0.0, std_of="others")
    assert a[0].item() == pytest.approx(0.0, abs=1e-12)
    assert a[1].item() == pytest.approx((1 - 11 / 3) / math.sqrt(13 / 3), rel=1e-12)
    # sample 3's others [3, 1, 2]: mean 2, std 1 -> 4
    assert a[3].item() == pytest.approx(4.0, rel=1e-12)


def test_leave_one_out_std_matches_brute_force_on_ragged_groups():
    groups = [[0.3, 1.0, 0.0, 0.7, 0.7], [5.0, -2.0, 1.5], [1.0, 0.0, 0.0, 0.0], [0.95] * 7 + [0.0], [2.0, 1.0]]
    rewards = torch.tensor([r for g in groups for r in g], dtype=torch.float64)
    gid = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor([len(g) for g in groups]))
    got = group_normalized(rewards, gid, "leave_one_out", normalize_std=True, eps=0.0, std_of="others").tolist()
    want = [x for g in groups for x in loo_reference(g)]
    assert close(got, want, 1e-9), (got, want)


def test_leave_one_out_std_never_divides_by_a_rounded_zero():
    # [0, 0.95 x 7]: the lone 0's others are all 0.95: only centred (-0.95), never -0.95 / ~1e-8
    a = group_normalized(torch.tensor([0.0] + [0.95] * 7), torch.zeros(8, dtype=torch.long), "leave_one_out",
                         std_of="others")
    assert a[0].item() == pytest.approx(-0.95, rel=1e-6)
    assert all(abs(x) < 10 for x in a.tolist())


def test_std_of_others_through_the_config_and_its_rules():
    cfg = AdvantageConfig(baseline="leave_one_out", std_of="others", std_eps=1e-12)
    out = compute_advantages(cfg, [[3.0, 1.0, 2.0, 6.0]])
    assert close(out[0], loo_reference([3.0, 1.0, 2.0, 6.0]), 1e-6)
    bad({"advantage": {"std_of": "others"}}, "advantage.std_of", "leave_one_out")
    bad({"advantage": {"std_of": "others", "baseline": "leave_one_out", "normalize_std": False}}, "advantage.std_of")
    bad({"advantage": {"estimator": "reinforce_pp", "std_of": "others"}}, "advantage.std_of", "grpo, gdpo")


# ---------------------------------------------------------------- validity mask


def test_invalid_samples_are_out_of_the_group_statistics_and_get_zero():
    # group [1, 0, 5, 0] with sample 2 invalid: statistics over [1, 0, 0] -> mean 1/3, std sqrt(1/3)
    r, gid = torch.tensor([1.0, 0.0, 5.0, 0.0]), torch.zeros(4, dtype=torch.long)
    valid = torch.tensor([True, True, False, True])
    a = group_normalized(r, gid, eps=0.0, valid=valid).tolist()
    s = math.sqrt(1 / 3)
    assert close(a, [(2 / 3) / s, (-1 / 3) / s, 0.0, (-1 / 3) / s])
    # leave-one-out: sample 0's valid others [0, 0] -> baseline 0
    a = group_normalized(r, gid, "leave_one_out", normalize_std=False, valid=valid).tolist()
    assert close(a, [1.0, -0.5, 0.0, -0.5])
    # default (no mask): the 5 counts, today's behaviour
    a = group_normalized(r, gid, normalize_std=False).tolist()
    assert close(a, [1 - 1.5, -1.5, 3.5, -1.5])


def test_validity_mask_through_estimate_advantages_for_each_estimator():
    mask = [[0, 1, 1]] * 4
    c = chunk(mask, sample_mask=[1.0, 1.0, 0.0, 1.0])  # sample 2 excluded from the loss
    rewards = [1.0, 0.0, 5.0, 0.0]
    on = {"exclude_invalid_from_stats": True}
    est = estimate_advantages(AdvantageConfig(normalize_std=False, **on), c, rewards, [4])
    assert close(est.sample_advantages.tolist(), [2 / 3, -1 / 3, 0.0, -1 / 3], 1e-6)
    # reinforce_pp: group mean over the valid [1, 0, 0], then whitened over the valid samples only
    est = estimate_advantages(AdvantageConfig(estimator="reinforce_pp", std_eps=1e-12, **on), c, rewards, [4])
    centred = [2 / 3, -1 / 3, -1 / 3]
    sd = statistics.stdev(centred)
    m = statistics.fmean(centred)
    assert close(est.sample_advantages.tolist(), [(centred[0] - m) / sd, (centred[1] - m) / sd, 0.0,
                                                  (centred[2] - m) / sd], 1e-5)
    # raw_reward whitened over the valid [1, 0, 0]
    est = estimate_advantages(AdvantageConfig(estimator="raw_reward", std_eps=1e-12, **on), c, rewards, [4])
    sd = statistics.stdev([1.0, 0.0, 0.0])
    assert close(est.sample_advantages.tolist(), [(2 / 3) / sd, (-1 / 3) / sd, 0.0, (-1 / 3) / sd], 1e-5)
    # an explicit validity vector (e.g. an aborted sample) overrides the sample mask
    est = estimate_advantages(AdvantageConfig(normalize_std=False, **on), c, rewards, [4],
                              valid=[True, True, True, False])
    assert close(est.sample_advantages.tolist(), [-1.0, -2.0, 3.0, 0.0], 1e-6)


def test_validity_mask_for_gae_whitens_over_valid_tokens_only():
    c = chunk([[1, 1], [1, 1]], sample_mask=[1.0, 0.0])
    values = torch.zeros(2, 2)
    cfg = AdvantageConfig(estimator="gae", gamma=1.0, lam=1.0, whiten=False, exclude_invalid_from_stats=True)
    est = estimate_advantages(cfg, c, [1.0, 3.0], [1, 1], values=values)
    assert est.advantages.tolist() == [[1.0, 1.0], [0.0, 0.0]]  # A = return - V; the invalid row is 0
    est = estimate_advantages(cfg.model_copy(update={"whiten": True}), c, [1.0, 3.0], [1, 1], values=values)
    assert est.advantages.tolist() == [[0.0, 0.0], [0.0, 0.0]]  # whitened over [1, 1] only: zero spread


# ---------------------------------------------------------------- GAE bootstrap at truncation


def test_gae_bootstraps_the_value_of_a_truncated_completion():
    # row 0 truncated, final value 2.0; row 1 stopped (its final value 7.0 is ignored).
    # V = [0.5, 0.2, 0.4], reward 1 on the last token, gamma 0.9, lam 0.8:
    # truncated: t2 delta = 1 + 0.9*2 - 0.4 = 2.4; t1 delta = 0.9*0.4 - 0.2 = 0.16 -> 0.16 + 0.72*2.4 = 1.888;
    #            t0 delta = 0.9*0.2 - 0.5 = -0.32 -> -0.32 + 0.72*1.888 = 1.03936
    # stopped:   t2 0.6; t1 0.16 + 0.72*0.6 = 0.592; t0 -0.32 + 0.72*0.592 = 0.10624
    c = chunk([[1, 1, 1], [1, 1, 1]])
    values = torch.tensor([[0.5, 0.2, 0.4], [0.5, 0.2, 0.4]])
    cfg = AdvantageConfig(estimator="gae", gamma=0.9, lam=0.8, whiten=False, bootstrap_truncated=True)
    est = estimate_advantages(cfg, c, [1.0, 1.0], [1, 1], values=values, truncated=[True, False],
                              final_values=torch.tensor([2.0, 7.0]))
    assert close(est.advantages[0].tolist(), [1.03936, 1.888, 2.4], 1e-5)
    assert close(est.advantages[1].tolist(), [0.10624, 0.592, 0.6], 1e-5)
    assert close(est.returns[0].tolist(), [1.53936, 2.088, 2.8], 1e-5)  # A + V
    off = estimate_advantages(cfg.model_copy(update={"bootstrap_truncated": False}), c, [1.0, 1.0], [1, 1],
                              values=values, truncated=[True, False], final_values=torch.tensor([2.0, 7.0]))
    assert close(off.advantages[0].tolist(), [0.10624, 0.592, 0.6], 1e-5)  # default: truncation is terminal
    with pytest.raises(ValueError, match="bootstrap_truncated"):
        estimate_advantages(cfg, c, [1.0, 1.0], [1, 1], values=values)
    bad({"advantage": {"bootstrap_truncated": True}}, "advantage.bootstrap_truncated", "gae")


# ---------------------------------------------------------------- unsaturated DAPO overlong penalty


def test_unsaturated_overlong_penalty_keeps_the_ramp_past_l_max():
    # L_max 10, L_cache 4, penalty 2: free up to 6, ramp (6 - l) / 4; beyond 10 -1 (saturated) or the ramp
    lengths = [5, 6, 8, 10, 12, 16]
    assert close(overlong_penalty(lengths, 10, 4, 2.0).tolist(), [0.0, 0.0, -1.0, -2.0, -2.0, -2.0])
    assert close(overlong_penalty(lengths, 10, 4, 2.0, saturate=False).tolist(), [0.0, 0.0, -1.0, -2.0, -3.0, -5.0])
    cfg = RewardShapingConfig(overlong_penalty={"enabled": True, "max_response_tokens": 10, "buffer_tokens": 4,
                                                "penalty": 2.0, "saturate": False})
    group = [Sample([1], list(range(n)), [0.0] * n, 1.0, "stop", 0, 0) for n in (8, 16)]
    out = shape_group(cfg, group, generation_max_tokens=32)
    assert close([s.reward for s in out.samples], [0.0, -4.0])
    assert close([s.rewards["overlong_penalty"] for s in out.samples], [-1.0, -5.0])


# ---------------------------------------------------------------- empty sequences in sequence aggregation


def test_empty_sequences_count_as_zero_when_asked():
    per_tok = torch.tensor([[1.0, 3.0, 0.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    s, n = aggregate(per_tok, mask, "sequence")
    assert (s.item(), n) == (6.0, 2.0)  # default: the empty row is dropped
    s, n = aggregate(per_tok, mask, "sequence", "zero")
    assert (s.item(), n) == (6.0, 3.0)  # (2 + 4 + 0) / 3
    # through the loss: an excluded sample (sample_mask 0) counts in the normaliser
    lp = torch.zeros(2, 2, requires_grad=True)
    c = chunk([[1, 1], [1, 1]], sample_mask=[1.0, 0.0], adv=[[1.0, 1.0], [5.0, 5.0]])
    base = dict(importance_sampling={"enabled": False}, aggregation="sequence")
    out = PolicyGradientLoss(LossConfig(**base, empty_sequences="zero"))(lp, c)
    assert (out.loss_sum.item(), out.normalizer) == (pytest.approx(-1.0), 2.0)
    out = PolicyGradientLoss(LossConfig(**base))(lp, c)
    assert (out.loss_sum.item(), out.normalizer) == (pytest.approx(-1.0), 1.0)
    bad({"loss": {"empty_sequences": "zero"}}, "loss.empty_sequences", "sequence")


# ---------------------------------------------------------------- one-sample groups, dual clip


def test_a_group_of_one_sample_gets_zero_not_an_error():
    assert compute_advantages(AdvantageConfig(), [[1.0]]) == [[0.0]]
    assert compute_advantages(AdvantageConfig(baseline="leave_one_out"), [[0.5]]) == [[0.0]]
    out = compute_advantages(AdvantageConfig(normalize_std=False), [[2.0, 0.0], [5.0]])
    assert out == [[1.0, -1.0], [0.0]]
    assert grpo_advantages(torch.tensor([[3.0]])).tolist() == [[0.0]]


@pytest.mark.parametrize("c", [1.0, 0.5, -2.0, float("nan")])
def test_clipped_pg_terms_refuses_a_dual_clip_constant_not_above_one(c):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        clipped_pg_terms(x, x, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), 0.2, 0.2, dual_clip_c=c)


def test_dual_clip_constant_is_refused_at_load_with_the_field_named():
    bad({"loss": {"dual_clip_c": 1.0}}, "loss.dual_clip_c")
    validate_dict({"loss": {"dual_clip_c": 3.0}})
