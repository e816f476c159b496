"""Recipe knobs of the algorithm library: defaults, combinations rejected at load with the promised
error (field, value, expectation, fix), resolved-config round trips, and dispatch from the config."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rl_core.config import load_resolved, validate_dict, write_resolved
from rl_core.errors import RecipeError

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-addition.yaml"


def bad(data, field, *needles):
    with pytest.raises(RecipeError) as err:
        validate_dict(data)
    text = str(err.value)
    assert f"`{field}`" in text and "Fix:" in text, text
    for n in needles:
        assert n in text, text
    return text


def test_defaults_keep_the_first_slice_behaviour():
    cfg = validate_dict({})
    assert (cfg.advantage.estimator, cfg.advantage.baseline, cfg.advantage.normalize_std) == ("grpo", "mean", True)
    assert (cfg.loss.type, cfg.loss.ratio_level, cfg.loss.dual_clip_c, cfg.loss.aggregation) == (
        "clipped_pg", "token", None, "token")
    isc = cfg.loss.importance_sampling
    assert (isc.enabled, isc.level, isc.truncation, isc.max_seq_mult_prob_error) == (True, "token", "tis", None)
    assert not cfg.critic.enabled and cfg.advantage.kl_in_reward_coef == 0.0
    rs = cfg.reward_shaping
    assert not (rs.overlong_filtering or rs.overlong_penalty.enabled or rs.scaling.enabled or rs.dynamic_sampling.enabled)


def test_kl_in_reward_and_kl_loss_are_exclusive():
    bad({"loss": {"kl_coef": 0.1}, "advantage": {"kl_in_reward_coef": 0.05}}, "loss.kl_coef", "not both")
    validate_dict({"advantage": {"kl_in_reward_coef": 0.05}})


def test_token_level_kl_in_reward_needs_a_per_token_return():
    bad({"advantage": {"kl_in_reward_coef": 0.1, "kl_in_reward_level": "token"}}, "advantage.kl_in_reward_level",
        "reinforce_pp or gae")
    validate_dict({"advantage": {"estimator": "reinforce_pp", "kl_in_reward_coef": 0.1, "kl_in_reward_level": "token"}})
    bad({"advantage": {"estimator": "gdpo", "kl_in_reward_coef": 0.1}}, "advantage.kl_in_reward_coef", "gdpo")


def test_seq_mask_tis_needs_sequence_level():
    bad({"loss": {"importance_sampling": {"truncation": "seq-mask-tis"}}}, "loss.importance_sampling.level",
        "seq-mask-tis")
    validate_dict({"loss": {"importance_sampling": {"truncation": "seq-mask-tis", "level": "sequence",
                                                    "min_ratio": 0.5}}})


def test_gae_and_the_critic_come_together():
    bad({"advantage": {"estimator": "gae"}}, "critic.enabled", "gae")
    bad({"critic": {"enabled": True}}, "critic.enabled", "grpo")
    text = bad({"critic": {"enabled": True}, "advantage": {"estimator": "raw_reward"}}, "critic.enabled", "raw_reward")
    assert "never used" in text
    cfg = validate_dict({"critic": {"enabled": True}, "advantage": {"estimator": "gae", "lam": 1.0, "value_lam": 1.0}})
    assert cfg.critic.value_clip_eps == 0.2


def test_knobs_of_another_estimator_or_loss_type_raise():
    bad({"advantage": {"whiten": False}}, "advantage.whiten", "grpo")
    bad({"advantage": {"estimator": "reinforce_pp", "baseline": "leave_one_out"}}, "advantage.baseline")
    bad({"advantage": {"lam": 0.9}}, "advantage.lam", "gae")
    bad({"advantage": {"reward_weights": {"correct": 1.0}}}, "advantage.reward_weights")
    bad({"loss": {"type": "reinforce", "dual_clip_c": 3.0}}, "loss.dual_clip_c", "reinforce")
    bad({"loss": {"type": "reinforce", "clip_eps_high": 0.28}}, "loss.clip_eps_high")
    validate_dict({"loss": {"type": "reinforce"}, "advantage": {"estimator": "raw_reward", "whiten": False}})


def test_loss_options():
    bad({"loss": {"ratio_level": "sequence"}}, "loss.aggregation", "GSPO")
    validate_dict({"loss": {"ratio_level": "sequence", "aggregation": "sequence", "clip_eps_low": 3e-4,
                            "clip_eps_high": 4e-4}})
    bad({"loss": {"dual_clip_c": 1.0}}, "loss.dual_clip_c")
    bad({"loss": {"importance_sampling": {"max_seq_mult_prob_error": 0.9}}},
        "loss.importance_sampling.max_seq_mult_prob_error")
    bad({"advantage": {"estimator": "gdpo", "reward_weights": {"correct": 0.0}}}, "advantage.reward_weights", "non-zero")


def test_reward_shaping_rules():
    bad({"reward_shaping": {"overlong_penalty": {"enabled": True, "buffer_tokens": 8}}},
        "reward_shaping.overlong_penalty.buffer_tokens", "L_max - 1 = 7")
    bad({"reward_shaping": {"overlong_penalty": {"enabled": True, "max_response_tokens": 9}}},
        "reward_shaping.overlong_penalty.max_response_tokens", "generation.max_tokens (8)")
    bad({"generation": {"max_tokens": 4}, "reward_shaping": {"overlong_penalty": {"enabled": True}}},
        "reward_shaping.overlong_penalty.buffer_tokens", "L_max // 5 = 0")
    validate_dict({"reward_shaping": {"overlong_penalty": {"enabled": True}}})  # 8 tokens, buffer 1
    bad({"reward_shaping": {"scaling": {"source_min": 1.0, "source_max": 1.0}}}, "reward_shaping.scaling.source_max")
    bad({"reward_shaping": {"scaling": {"target_min": 2.0, "target_max": 2.0}}}, "reward_shaping.scaling.target_max")
    bad({"advantage": {"estimator": "gdpo"}, "reward_shaping": {"scaling": {"enabled": True}}},
        "reward_shaping.scaling.enabled", "gdpo")
    bad({"advantage": {"estimator": "gdpo", "reward_weights": {"correct": 1.0}},
         "reward_shaping": {"overlong_penalty": {"enabled": True}}}, "advantage.reward_weights", "overlong_penalty")
    validate_dict({"advantage": {"estimator": "gdpo", "reward_weights": {"correct": 1.0, "overlong_penalty": 0.5}},
                   "reward_shaping": {"overlong_penalty": {"enabled": True}, "overlong_filtering": True,
                                      "dynamic_sampling": {"enabled": True}}})


@pytest.mark.parametrize("data", [
    {"advantage": {"estimator": "gdpo"}},
    {"advantage": {"kl_in_reward_coef": 0.1, "estimator": "reinforce_pp"}},
    {"reward_shaping": {"overlong_filtering": True}},
    {"reward_shaping": {"dynamic_sampling": {"enabled": True}}},
    {"critic": {"enabled": True}, "advantage": {"estimator": "gae"}},
])
def test_options_the_controller_applies_load(data):
    validate_dict(data)


def test_resolved_config_round_trip_with_non_default_knobs(tmp_path):
    cfg = validate_dict({"advantage": {"estimator": "reinforce_pp", "whiten": False, "subtract_group_mean": False},
                         "loss": {"type": "reinforce", "kl_coef": 0.01, "kl_output_clamp": None,
                                  "importance_sampling": {"truncation": "icepop", "min_ratio": 0.5}},
                         "critic": {"lr": 3e-5}})
    write_resolved(cfg, tmp_path)
    assert load_resolved(tmp_path) == cfg


def test_make_loss_dispatch_from_config():
    from rl_core.algorithms.losses import PolicyGradientLoss, make_loss

    loss = make_loss(validate_dict({"loss": {"type": "reinforce", "kl_coef": 0.1}}).loss)
    assert isinstance(loss, PolicyGradientLoss) and loss.cfg.type == "reinforce" and loss.needs_reference_logprobs


def test_cli_validate_reports_an_algorithm_combination():
    code = textwrap.dedent(f"""
        import sys
        from rl_core.launch.cli import main
        sys.exit(main(["validate", {str(RECIPE)!r}, "--out", {str(ROOT / ".pytest_cache" / "algo_cli")!r},
                       "loss.importance_sampling.truncation=seq-mask-tis"]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in err and "`loss.importance_sampling.level`" in err and "Fix:" in err, err


def test_preflight_checks_the_critic_model_path(tmp_path, monkeypatch):
    from rl_core.launch.preflight import preflight

    monkeypatch.chdir(ROOT)
    cfg = validate_dict({"critic": {"enabled": True, "model_path": str(tmp_path / "nope")},
                         "advantage": {"estimator": "gae"}})
    with pytest.raises(RecipeError, match="critic.model_path"):
        preflight(cfg)
    (tmp_path / "nope").mkdir()
    (tmp_path / "nope" / "config.json").write_text("{}")
    preflight(cfg)
