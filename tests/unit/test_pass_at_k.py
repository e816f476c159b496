"""Unbiased pass@k (Chen et al. 2021, eq. 1) against brute force over every k-subset of the n
samples, exact at k = 1 (c / n) and k = n (any correct), and in the validation record."""

import asyncio
import itertools
from fractions import Fraction

import pytest

from rl_core.config.schema import ValidationConfig
from rl_core.rollout.validation import Validator, pass_at_k
from rl_core.types import EnvResult, GenerationResult


def brute_force(n: int, c: int, k: int) -> Fraction:
    """Share of the k-subsets of n samples (the first c correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(1 for s in subsets if any(i < c for i in s)), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_brute_force_for_every_k_and_c(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(brute_force(n, c, k)), abs=1e-12), (n, c, k)


def test_exact_at_k_1_and_k_n():
    for n in (1, 5, 16, 100):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-12)
            assert pass_at_k(n, c, n) == (1.0 if c > 0 else 0.0)


def test_hand_values_and_large_n_stays_finite():
    # n = 4, c = 1, k = 2: 3 of the 6 pairs hold the correct sample
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n = 5, c = 2, k = 3: 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    # binomials of this size overflow a float; the product form does not
    v = pass_at_k(2000, 3, 100)
    assert 0.0 < v < 1.0 and v == pytest.approx(1 - (1900 * 1899 * 1898) / (2000 * 1999 * 1998), rel=1e-12)


def test_out_of_range_arguments_raise():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 0)
    with pytest.raises(ValueError, match="correct samples"):
        pass_at_k(4, 5, 2)


class ScriptedBackend:
    """A fake backend (this test is about the validator's arithmetic): answers request i of prompt p with token 1 (correct) when (p, i) is in `correct`, else 2."""

    weight_version = 3

    def __init__(self, correct):
        self.correct = correct

    async def generate(self, request):
        p, i = request.request_id.split("-")[-1].split("/")
        tok = 1 if (int(p), int(i)) in self.correct else 2
        return GenerationResult(request.request_id, list(request.prompt_ids), [tok], [-0.1], "stop", 3, 3)


class OneTokenEnv:
    max_turns = 1
    runs_episodes = False  # not an agent environment

    def stop_strings(self):
        return ()

    def prompt_ids(self, example):
        return [5, 6]

    def score(self, example, completion_ids, text, finish_reason):
        return EnvResult(reward=1.0 if completion_ids == [1] else 0.0)


def test_validation_record_reports_unbiased_pass_at_k_beside_the_old_metrics():
    # 3 prompts x 4 samples: correct counts 1, 0, 4
    correct = {(0, 2), (2, 0), (2, 1), (2, 2), (2, 3)}
    cfg = ValidationConfig(num_val_generations_per_prompt=4)

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    v = Validator(cfg, OneTokenEnv(), Tok(), [{"prompt": f"p{i}"} for i in range(3)], seed=0)
    rec = asyncio.run(v.run(ScriptedBackend(correct)))
    per_prompt = [1, 0, 4]
    assert rec["accuracy"] == pytest.approx(5 / 12)
    assert rec["pass@4"] == pytest.approx(2 / 3)  # any of 4 correct
    for k in range(1, 5):
        want = sum(float(brute_force(4, c, k)) for c in per_prompt) / 3
        assert rec["pass_at_k"][str(k)] == pytest.approx(want)
    assert rec["pass_at_k"]["1"] == pytest.approx(rec["accuracy"])
    assert rec["pass_at_k"]["4"] == pytest.approx(rec["pass@4"])
