"""Off-policy correction (importance weights, truncation modes, logprob-error masking, metrics)
and the (sum, count) metric reduction, against values written out by hand."""

import math

import pytest
import torch

from rl_core.algorithms.metrics import finalize_metrics, merge_metrics, reduce_kind
from rl_core.algorithms.offpolicy import correct_off_policy, importance_weights, seq_mult_prob_error

LN = math.log


def close(a, b, tol=1e-6):
    return all(abs(x - y) < tol for x, y in zip(a, b, strict=True))


# prev - gen per token: ln 3, ln 0.5, 0  -> token weights 3, 0.5, 1
PREV = torch.tensor([[-1.0, -2.0, -3.0]])
GEN = torch.tensor([[-1.0 - LN(3.0), -2.0 - LN(0.5), -3.0]])
MASK = torch.ones(1, 3)


def test_token_level_truncation_modes():
    w, out = importance_weights(PREV, GEN, MASK, "token", "none", 0.6, 2.0)
    assert close(w[0].tolist(), [3.0, 0.5, 1.0]) and out[0].tolist() == [True, True, False]
    w, _ = importance_weights(PREV, GEN, MASK, "token", "tis", 0.6, 2.0)
    assert close(w[0].tolist(), [2.0, 0.6, 1.0])
    w, _ = importance_weights(PREV, GEN, MASK, "token", "icepop", 0.6, 2.0)
    assert close(w[0].tolist(), [0.0, 0.0, 1.0])


def test_sequence_level_weight_is_the_product_and_masks_whole_sequences():
    # product 3 * 0.5 * 1 = 1.5 over the valid tokens; with the last token masked still 1.5
    w, out = importance_weights(PREV, GEN, MASK, "sequence", "none", 0.0, 10.0)
    assert close(w[0].tolist(), [1.5, 1.5, 1.5]) and not out.any()
    w, out = importance_weights(PREV, GEN, torch.tensor([[1.0, 0.0, 1.0]]), "sequence", "tis", 0.0, 2.0)
    assert close(w[0].tolist(), [2.0, 2.0, 2.0])  # 3 * 1 = 3 -> clamped to 2
    w, out = importance_weights(PREV, GEN, torch.tensor([[1.0, 0.0, 1.0]]), "sequence", "icepop", 0.0, 2.0)
    assert w[0].tolist() == [0.0, 0.0, 0.0] and out.all()


def test_seq_mask_tis_geometric_mean_decides_raw_token_weights_stay():
    # row 0: log-ratios ln 3, -ln 3 -> geometric mean 1 (kept): raw token weights 3 and 1/3
    # row 1: ln 4, ln 4 -> geometric mean 4 > 2: every token of the row gets weight 0
    # row 2: nothing valid: never flagged
    prev = torch.zeros(3, 2)
    gen = torch.tensor([[-LN(3.0), LN(3.0)], [-LN(4.0), -LN(4.0)], [5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    w, out = importance_weights(prev, gen, mask, "sequence", "seq-mask-tis", 0.5, 2.0)
    assert close(w[0].tolist(), [3.0, 1 / 3]) and w[1].tolist() == [0.0, 0.0]
    assert out.tolist() == [[False, False], [True, True], [False, False]]
    with pytest.raises(ValueError, match="level 'sequence'"):
        importance_weights(prev, gen, mask, "token", "seq-mask-tis", 0.5, 2.0)


def test_unknown_level_or_truncation():
    with pytest.raises(ValueError, match="truncation"):
        importance_weights(PREV, GEN, MASK, "token", "clip", 0.0, 2.0)
    with pytest.raises(ValueError, match="level"):
        importance_weights(PREV, GEN, MASK, "chunk", "tis", 0.0, 2.0)


def test_seq_mult_prob_error_by_hand():
    # row 0: |gen - prev| = [0, ln 2] -> exp = [1, 2] -> mean 1.5 ; row 1 has no valid token -> 1.0
    prev = torch.zeros(2, 2)
    gen = torch.tensor([[0.0, -LN(2.0)], [3.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert close(seq_mult_prob_error(prev, gen, mask).tolist(), [1.5, 1.0])


def test_correct_off_policy_metrics_and_threshold_mask():
    # row 0: log-ratios (prev - gen) [ln 2, 0] -> token weights [2, 1], error (2 + 1) / 2 = 1.5
    # row 1: [0, 0] -> weights [1, 1], error 1 ; row 2: all masked
    prev = torch.zeros(3, 2)
    gen = torch.tensor([[-LN(2.0), 0.0], [0.0, 0.0], [1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    c = correct_off_policy(prev, gen, mask, level="token", truncation="tis", min_ratio=0.0, max_ratio=1.5,
                           max_seq_mult_prob_error=1.2)
    assert c.mask.tolist() == [[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]  # row 0 dropped by the threshold
    assert close(c.weights[0].tolist(), [1.5, 1.0]) and close(c.weights[1].tolist(), [1.0, 1.0])
    m = c.metrics
    assert m["seq_mult_prob_error"] == (pytest.approx(2.5), 2.0)
    assert m["seq_mult_prob_error_max"] == (pytest.approx(1.5), 1.0)
    assert m["seq_masked_by_prob_error_frac"] == (1.0, 2.0)
    assert m["is_oob_frac"] == (1.0, 4.0)  # the weight 2 > 1.5, counted over the input mask
    assert m["is_weight"] == (2.0, 2.0)  # over the kept tokens (row 1)
    assert m["is_weight_min"] == (1.0, 1.0) and m["is_weight_max"] == (1.0, 1.0)
    assert m["is_mult_prob_error"] == (pytest.approx(5.0), 4.0)  # 2 + 1 + 1 + 1
    assert m["gen_logprob_abs_error"] == (pytest.approx(LN(2.0)), 4.0)
    # k3 of KL(gen || prev) on row 0 token 0: log r = prev - gen = ln 2 -> 2 - 1 - ln 2
    assert m["gen_train_kl"] == (pytest.approx(1.0 - LN(2.0)), 4.0)


def test_correct_off_policy_disabled_gives_unit_weights_but_still_masks():
    prev = torch.zeros(1, 2)
    gen = torch.tensor([[-LN(3.0), 0.0]])
    c = correct_off_policy(prev, gen, torch.ones(1, 2), enabled=False, max_seq_mult_prob_error=1.5)
    assert c.weights.tolist() == [[1.0, 1.0]] and c.mask.tolist() == [[0.0, 0.0]]
    assert "is_weight" not in c.metrics


def test_all_tokens_masked_metrics_are_empty_pairs():
    c = correct_off_policy(torch.zeros(2, 2), torch.ones(2, 2), torch.zeros(2, 2))
    assert c.metrics["is_weight_min"] == (0.0, 0.0) and c.metrics["seq_mult_prob_error"] == (0.0, 0.0)
    assert c.metrics["is_oob_frac"] == (0.0, 0.0)


def test_metric_reduction_convention():
    assert [reduce_kind(n) for n in ("is_weight_min", "x_max", "ratio")] == ["min", "max", "mean"]
    acc: dict = {}
    merge_metrics(acc, {"ratio": (3.0, 2.0), "w_min": (0.0, 0.0), "w_max": (2.0, 1.0)})
    merge_metrics(acc, {"ratio": (1.0, 2.0), "w_min": (0.7, 1.0), "w_max": (1.5, 1.0)})
    merge_metrics(acc, {"ratio": (0.0, 0.0), "w_min": (0.4, 1.0), "w_max": (0.0, 0.0)})
    assert finalize_metrics(acc) == {"ratio": 1.0, "w_min": 0.4, "w_max": 2.0}
    assert finalize_metrics({"empty": [0.0, 0.0]}) == {"empty": 0.0}
