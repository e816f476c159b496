"""The adaptive staleness bound of the `in_order` sampler (`async_rl.sampler.adaptive`): the rule
on given metric sequences, the bound dispatch uses at each version, the per-step admitted
bound, the state_dict round trip (the same bound sequence after a resume), and config errors."""

import json

import pytest

from rl_core.config import validate_dict
from rl_core.config.schema import required_buffer_capacity
from rl_core.errors import RecipeError
from rl_core.samplers import make_sampler

from tests.helpers.recipes import recipe

KEY = "train/gen_train_kl"


def _cfg(start=1, p=2, **adaptive):
    ad = {"enabled": True, "min_lookahead_versions": 0, "max_lookahead_versions": 3, "low_threshold": 1e-3,
          "high_threshold": 3e-3, "patience_steps": 2, **adaptive}
    return recipe(grpo={"num_prompts_per_step": p},
                  async_rl={"sampler": {"type": "in_order", "max_lookahead_versions": start, "adaptive": ad}})


def _bounds(sampler, signals, first_step=0):
    return [int(sampler.observe(first_step + i, {KEY: x})["async/staleness_bound"]) for i, x in enumerate(signals)]


LOW, MID, HIGH = 1e-4, 2e-3, 1e-2


def test_rule_widens_after_patience_narrows_at_once_and_holds_in_the_band():
    s = make_sampler(_cfg(start=1))
    assert s.staleness_bound == 1 and s.lookahead == 3  # largest bound sizes dispatch
    seq = [LOW, LOW, LOW, LOW, LOW, LOW, LOW, HIGH, LOW, MID, LOW, LOW, HIGH, HIGH, HIGH, HIGH, LOW]
    # patience 2: two lows -> +1 (count restarts); capped at 3; HIGH -> -1 at once; MID resets the count
    assert _bounds(s, seq) == [1, 2, 2, 3, 3, 3, 3, 2, 2, 2, 2, 3, 2, 1, 0, 0, 0]
    assert s.adaptive.changes == 7


def test_thresholds_are_strict_and_other_metrics_are_read():
    s = make_sampler(_cfg(start=1, patience_steps=1))
    assert _bounds(s, [1e-3, 3e-3]) == [1, 1]  # equal to low: not low; equal to high: not high
    s = make_sampler(_cfg(start=1, patience_steps=1, metric="is_mult_prob_error", low_threshold=1.01,
                          high_threshold=1.05))
    out = s.observe(0, {"train/is_mult_prob_error": 1.001, KEY: 99.0})
    assert out["async/staleness_bound"] == 2 and out["async/staleness_signal"] == 1.001
    with pytest.raises(RuntimeError, match="train/is_mult_prob_error"):
        s.observe(1, {KEY: 0.0})
    with pytest.raises(RuntimeError, match="finite"):
        s.observe(1, {"train/is_mult_prob_error": float("nan")})


def test_decision_after_step_t_applies_from_version_t_plus_1():
    p = 2
    s = make_sampler(_cfg(start=1, p=p, patience_steps=1))
    for _ in range(2 * p):  # steps 0 and 1 admitted at version 0 (bound 1)
        s.admit(0)
    assert not s.can_admit(0)
    assert s.observe(0, {KEY: LOW})["async/staleness_bound"] == 2  # decided after step 0 for versions >= 1
    assert s.lookahead_at(0) == 1 and s.lookahead_at(1) == 2
    assert not s.can_admit(0)  # the clock has not published version 1 yet: still bound 1
    for _ in range(2 * p):  # version 1, bound 2: steps 2 and 3
        s.admit(1)
    assert not s.can_admit(1) and s.next_target_step() == 4
    assert s.admitted_bound == {1: 1, 2: 2, 3: 2}
    assert s.observe(1, {KEY: HIGH})["async/trained_staleness_bound"] == 1  # step 1's groups: bound 1
    assert s.lookahead_at(2) == 1  # narrowed: step 3 + ... nothing new admits at version 2
    assert not s.can_admit(2) and s.can_admit(3)
    assert s.observe(2, {KEY: MID})["async/trained_staleness_bound"] == 2  # admitted wider: guarantee is 2


def test_fixed_bound_logs_the_bound_and_never_moves():
    s = make_sampler(validate_dict({"async_rl": {"sampler": {"type": "in_order", "max_lookahead_versions": 2}}}))
    assert s.adaptive is None
    outs = [s.observe(i, {}) for i in range(3)]  # no metric needed without adaptive
    assert [o["async/staleness_bound"] for o in outs] == [2, 2, 2] and "async/staleness_signal" not in outs[0]


def test_state_dict_round_trip_gives_the_same_bound_sequence():
    seq = [LOW, LOW, HIGH, LOW, LOW, LOW, MID, LOW, LOW, HIGH, HIGH, LOW, LOW, LOW, LOW]
    full = make_sampler(_cfg(start=1))
    for _ in range(3):
        full.admit(0)
    ref = _bounds(full, seq)
    for cut in range(1, len(seq)):
        a = make_sampler(_cfg(start=1))
        for _ in range(3):
            a.admit(0)
        head = _bounds(a, seq[:cut])
        state = json.loads(json.dumps(a.state_dict()))  # checkpoints are JSON
        b = make_sampler(_cfg(start=1))
        b.load_state_dict(state)
        assert b.state_dict() == a.state_dict()
        assert b.lookahead_at(cut - 1) == a.lookahead_at(cut - 1) and b.lookahead_at(cut) == a.lookahead_at(cut)
        assert head + _bounds(b, seq[cut:], first_step=cut) == ref, cut


def test_resume_with_another_adaptive_setting_is_refused():
    a = make_sampler(_cfg(start=1))
    fixed = make_sampler(validate_dict({"async_rl": {"sampler": {"type": "in_order"}}}))
    with pytest.raises(ValueError, match="adaptive.enabled"):
        fixed.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="adaptive.enabled"):
        a.load_state_dict(fixed.state_dict())
    st = a.state_dict()
    st["adaptive"]["bound"] = 7
    with pytest.raises(ValueError, match=r"outside the recipe's range \[0, 3\]"):
        make_sampler(_cfg(start=1)).load_state_dict(st)


def test_fixed_bound_is_the_recipes_not_the_checkpoints():
    two = make_sampler(validate_dict({"async_rl": {"sampler": {"type": "in_order", "max_lookahead_versions": 2}}}))
    one = make_sampler(validate_dict({"async_rl": {"sampler": {"type": "in_order", "max_lookahead_versions": 1}}}))
    one.load_state_dict(two.state_dict())
    assert one.staleness_bound == 1 and one.lookahead_at(5) == 1


def test_config_errors_name_the_field():
    with pytest.raises(RecipeError, match=r"async_rl\.sampler\.adaptive\.min_lookahead_versions"):
        _cfg(start=2, min_lookahead_versions=3, max_lookahead_versions=2)
    with pytest.raises(RecipeError, match=r"async_rl\.sampler\.adaptive\.low_threshold.*below"):
        _cfg(low_threshold=3e-3, high_threshold=3e-3)
    with pytest.raises(RecipeError, match=r"async_rl\.sampler\.adaptive\.low_threshold.*never below 1"):
        _cfg(metric="is_mult_prob_error", low_threshold=0.5, high_threshold=1.5)
    with pytest.raises(RecipeError, match=r"async_rl\.sampler\.max_lookahead_versions.*starting bound"):
        _cfg(start=4)  # outside [0, 3]
    with pytest.raises(RecipeError, match=r"patience_steps"):
        _cfg(patience_steps=0)
    with pytest.raises(RecipeError, match=r"adaptive"):  # only in_order has an adaptive bound
        validate_dict({"async_rl": {"sampler": {"type": "windowed", "adaptive": {"enabled": True}}}})
    # off by default, and then its range is not checked against the fixed bound
    cfg = validate_dict({"async_rl": {"sampler": {"type": "in_order", "max_lookahead_versions": 9}}})
    assert cfg.async_rl.sampler.adaptive.enabled is False


def test_reproducible_buffer_is_sized_for_the_largest_bound():
    cfg = validate_dict({"grpo": {"num_prompts_per_step": 2},
                         "async_rl": {"reproducible": True, "max_buffered_groups": 8,
                                      "sampler": {"type": "in_order", "max_lookahead_versions": 1,
                                                  "adaptive": {"enabled": True, "max_lookahead_versions": 3}}}})
    assert required_buffer_capacity(cfg) == 8 and make_sampler(cfg).required_capacity() == 8
    with pytest.raises(RecipeError, match="async_rl.max_buffered_groups"):
        validate_dict({"grpo": {"num_prompts_per_step": 2},
                       "async_rl": {"reproducible": True, "max_buffered_groups": 7,
                                    "sampler": {"type": "in_order", "max_lookahead_versions": 1,
                                                "adaptive": {"enabled": True, "max_lookahead_versions": 3}}}})


def test_a_step_admitted_under_another_bound_is_no_evidence_about_the_current_one():
    from rl_core.samplers.adaptive import AdaptiveBound

    r = AdaptiveBound(_cfg(start=2).async_rl.sampler.adaptive, start=2)
    assert r.update({KEY: HIGH}, trained_bound=2) == 1  # narrowed
    assert r.update({KEY: HIGH}, trained_bound=2) == 1  # still the old, wider groups: no second narrowing
    assert r.update({KEY: HIGH}, trained_bound=1) == 0  # the narrowed bound is still too wide
    assert r.update({KEY: LOW}, trained_bound=0) == 0 and r.low_streak == 1
    assert r.update({KEY: LOW}, trained_bound=0) == 1 and r.low_streak == 0  # patience 2: widened
    assert r.update({KEY: LOW}, trained_bound=0) == 1 and r.low_streak == 0  # widening not yet in training
    assert r.update({KEY: LOW}, trained_bound=1) == 1 and r.low_streak == 1
    assert r.update({KEY: HIGH}, trained_bound=0) == 0  # high even under a narrower bound: narrow


def test_default_range_floor_is_the_default_fixed_bound():
    # defaults: range [1, 4] (one-step-off is the floor: never synchronous unless min is set to 0)
    cfg = validate_dict({"async_rl": {"sampler": {"type": "in_order", "adaptive": {"enabled": True}}}})
    ad = cfg.async_rl.sampler.adaptive
    assert (ad.min_lookahead_versions, ad.max_lookahead_versions) == (1, 4)
    assert cfg.async_rl.sampler.max_lookahead_versions == 1  # the starting bound lies in the range
    s = make_sampler(cfg)
    assert _bounds(s, [HIGH] * 3 + [LOW] * 5 + [HIGH] * 3) == [1, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1]
    with pytest.raises(RecipeError, match=r"async_rl\.sampler\.max_lookahead_versions.*starting bound"):
        validate_dict({"async_rl": {"sampler": {"type": "in_order", "max_lookahead_versions": 0,
                                                "adaptive": {"enabled": True}}}})
