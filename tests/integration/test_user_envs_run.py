"""User tasks drive real runs: an environment class and reward functions defined in a module
under tmp_path (not in the package), found by import path, train for a counted number of RL
steps on the tiny model; and the examples/ folder's recipes run as documented.

The policy is the tiny model without warm-up (built once for the module, a few seconds):
these tests are about the plumbing (every sample scored by the user's code, its components
logged, the weighted total trained on), not about learning, which tests/integration/
test_learning.py covers."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from tests.helpers.paths import ROOT

USER_MODULE = '''
from rl_core.envs.base import BaseEnv
from rl_core.types import EnvResult

env_calls = []
fn_calls = []


class LengthEnv(BaseEnv):
    """Reward 1 for an answer of the right length that ended; the right answer on top."""
    name = "length_env"
    reward_names = ("length", "exact")

    def __init__(self, config, tokenizer):
        super().__init__(config, tokenizer)
        self.exact_weight = config.kwargs["exact_weight"]

    def score_completion(self, example, completion):
        env_calls.append(completion.text)
        length = float(completion.ended and len(completion.text) == len(example["answer"]))
        exact = float(completion.ended and completion.text == example["answer"])
        return EnvResult(reward=length + self.exact_weight * exact, rewards={"length": length, "exact": exact})


def exact(prompt, completion, example):
    fn_calls.append((prompt, completion, example["answer"], example["a"], example["b"]))
    return completion == example["answer"]


def short(prompt, completion, example):
    return -0.05 * len(completion)


def flaky(prompt, completion, example):
    if example["a"] % 2:
        raise ZeroDivisionError("odd operand")
    return 1.0
'''

STEPS = 3
NO_WARMUP = "model.warmup.enabled=false"


@pytest.fixture(scope="module")
def cold_policy(tmp_path_factory):
    """The default recipe's tiny model and tokenizer, not warmed up."""
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import ensure_policy, setup_process

    out = tmp_path_factory.mktemp("cold") / "init_policy"
    cfg = load_recipe(ROOT / "recipes" / "tiny-addition.yaml", [NO_WARMUP])
    setup_process(cfg)
    ensure_policy(cfg, out)
    return out


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    d = tmp_path / "user_code"
    d.mkdir()
    (d / "user_tasks_mod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(d))
    yield sys.modules.setdefault("user_tasks_mod", __import__("user_tasks_mod"))
    sys.modules.pop("user_tasks_mod", None)


def _train(recipe, tmp_path, policy, name, *overrides):
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import train_from_recipe

    cfg = load_recipe(recipe, [f"output_dir={tmp_path}", f"run_name={name}", "logging.tensorboard=false",
                               f"grpo.max_num_steps={STEPS}", "validation.val_at_start=false", NO_WARMUP,
                               *overrides])
    shutil.copytree(policy, tmp_path / name / "init_policy")
    summary = train_from_recipe(cfg)
    metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return summary, [m for m in metrics if "train/reward_mean" in m]


def test_custom_env_from_a_user_module_trains(tmp_path, cold_policy, monkeypatch, user_module):
    monkeypatch.chdir(ROOT)
    summary, steps = _train(ROOT / "recipes" / "tiny-addition-short.yaml", tmp_path, cold_policy, "custom",
                            "env={type: custom, target: 'user_tasks_mod:LengthEnv', kwargs: {exact_weight: 2.0}}")
    assert summary["rl_steps"] == STEPS and len(steps) == STEPS
    assert len(user_module.env_calls) >= STEPS * 8 * 4  # prompts x samples per step, every step
    assert {"reward/length", "reward/exact"} <= set(steps[-1])
    assert all(m["train/reward_mean"] == pytest.approx(m["reward/length"] + 2.0 * m["reward/exact"], abs=1e-6)
               for m in steps)


def test_reward_functions_from_a_user_module_train(tmp_path, cold_policy, monkeypatch, user_module):
    monkeypatch.chdir(ROOT)
    env = ("env={type: reward_functions, functions: [{target: 'user_tasks_mod:exact', name: correct}, "
           "{target: 'user_tasks_mod:short', weight: 0.5}], success: {component: correct}}")
    summary, steps = _train(ROOT / "recipes" / "tiny-addition-short.yaml", tmp_path, cold_policy, "rf", env)
    assert summary["rl_steps"] == STEPS and len(steps) == STEPS
    prompt, completion, answer, a, b = user_module.fn_calls[-1]
    assert prompt.endswith("=") and isinstance(a, int) and isinstance(b, int)  # other columns reach the function
    assert answer == f"{a + b:03d}"[::-1]
    assert {"reward/correct", "reward/short"} <= set(steps[-1])
    for m in steps:  # total = 1.0 * correct + 0.5 * short, averaged over the step's samples
        assert m["train/reward_mean"] == pytest.approx(m["reward/correct"] + 0.5 * m["reward/short"], abs=1e-6)


def test_a_raising_reward_function_is_an_environment_error(tmp_path, cold_policy, monkeypatch, user_module):
    """Default resilience policy: one data attempt per group, no dropped groups: the run stops,
    naming the function; with a drop budget the failing groups are dropped and the run goes on."""
    monkeypatch.chdir(ROOT)
    env = "env={type: reward_functions, functions: [{target: 'user_tasks_mod:flaky'}]}"
    with pytest.raises(Exception, match=r"reward function flaky \(user_tasks_mod:flaky\) raised ZeroDivisionError"):
        _train(ROOT / "recipes" / "tiny-addition-short.yaml", tmp_path, cold_policy, "flaky", env)


@pytest.mark.parametrize("example", ["custom_env", "reward_functions"])
def test_examples_run(tmp_path, cold_policy, monkeypatch, example):
    monkeypatch.chdir(ROOT)  # the recipes' targets are examples.<folder>.<module>, found from the working directory
    summary, steps = _train(ROOT / "examples" / example / "recipe.yaml", tmp_path, cold_policy, example)
    assert summary["rl_steps"] == STEPS and len(steps) == STEPS
    sys.modules.pop(f"examples.{example}.my_env", None)
