"""Train-step retries on the real loop (native engine, real torch trainer and critic, real
checkpoints): a non-finite gradient at the update is retried up to
`async_rl.failure.max_train_step_retries` and the step then succeeds; with the budget used up
the run stops with `TrainStepFailed`, a checkpoint of the last good state is written and no
trainer step is left open; failing previous-/reference-logprob, critic-value and
critic-update passes are retried too.

Faults come from wrappers around the real parts: the update's fault is a NaN written into a
real gradient just before the real `finish`, which refuses it (`FloatingPointError`)."""

from __future__ import annotations

import json

import pytest

import rl_core.launch.train as launch_train
from rl_core.launch.preflight import load_recipe
from rl_core.checkpoint import load_run_checkpoint, newest_complete
from rl_core.controller.train_pump import TrainStepFailed

from tests.helpers.paths import TINY_RECIPE as RECIPE

SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "validation.val_at_start=false",
         "validation.val_at_end=false", "async_rl.min_groups_for_streaming_train=2"]


def _poison_grad(module) -> None:
    """A NaN in the first real gradient: the update's gradient norm is then not finite."""
    p = next(p for p in module.parameters() if p.grad is not None)
    p.grad.view(-1)[0] = float("nan")


class PoisonedUpdates:
    """Wraps the real torch trainer: the update of RL step `step` meets a NaN gradient the first
    `times` times (after letting `skip` updates through); logprob passes may raise too (`fail_logprobs`: {reference?: failures left})."""

    def __init__(self, inner, step: int = -1, times: int = 0, fail_logprobs: dict | None = None, skip: int = 0):
        self.inner = inner
        self.step, self.times, self.skip = step, times, skip  # skip: updates of `step` let through first
        self.poisoned = 0
        self.finish_calls: dict[int, int] = {}
        self.fail_logprobs = dict(fail_logprobs or {})
        self.logprob_failures = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def version(self):
        return self.inner.version

    def finish(self, advance_version: bool = True):
        v = self.inner.version
        self.finish_calls[v] = self.finish_calls.get(v, 0) + 1
        if v == self.step and self.finish_calls[v] > self.skip and self.poisoned < self.times:
            self.poisoned += 1
            _poison_grad(self.inner.model)
        return self.inner.finish(advance_version)

    def logprobs(self, chunk, reference: bool = False):
        if self.fail_logprobs.get(reference, 0) > 0:
            self.fail_logprobs[reference] -= 1
            self.logprob_failures += 1
            raise RuntimeError(f"injected: {'reference' if reference else 'previous-policy'} logprob pass failed")
        return self.inner.logprobs(chunk, reference)


class FlakyCritic:
    """Wraps the real critic: its value pass raises once, its first update meets a NaN gradient."""

    def __init__(self, inner):
        self.inner = inner
        self.values_failed = self.updates_poisoned = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def values(self, chunk, with_final: bool = False):
        if not self.values_failed:
            self.values_failed += 1
            raise RuntimeError("injected: critic value pass failed")
        return self.inner.values(chunk, with_final)

    def finish(self, advance_version: bool = True):
        if not self.updates_poisoned:
            self.updates_poisoned += 1
            _poison_grad(self.inner.model)
        return self.inner.finish(advance_version)


def _wrap_parts(monkeypatch, wrap_trainer, wrap_critic=None) -> dict:
    """Make the real `build_parts` hand out wrapped parts; returns what was built."""
    built: dict = {}
    real = launch_train.build_parts

    def build(*args, **kwargs):
        parts = real(*args, **kwargs)
        parts.trainer = built["trainer"] = wrap_trainer(parts.trainer)
        if wrap_critic is not None:
            parts.critic = built["critic"] = wrap_critic(parts.critic)
        return parts

    monkeypatch.setattr(launch_train, "build_parts", build)
    return built


def _train_records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def test_transient_update_failure_is_retried_up_to_the_budget(run_recipe, monkeypatch):
    # three non-finite updates at RL step 1 with a budget of 3: the fourth try succeeds
    built = _wrap_parts(monkeypatch, lambda t: PoisonedUpdates(t, step=1, times=3))
    summary, run_dir = run_recipe(*SMALL, "grpo.max_num_steps=3", "async_rl.failure.max_train_step_retries=3",
                                  name="retry_ok")
    tr = built["trainer"]
    assert summary["rl_steps"] == 3
    assert tr.poisoned == 3 and tr.finish_calls == {0: 1, 1: 4, 2: 1}
    assert tr.inner._loss is None  # no step left open
    recs = _train_records(run_dir)
    assert [r["train/step_retries_total"] for r in recs] == [0.0, 3.0, 3.0]
    assert recs[-1]["train/pass_retries_total"] == 0.0
    assert all(r["train/grad_norm"] == r["train/grad_norm"] for r in recs)  # finite (not NaN) after the retries


def test_update_failures_beyond_the_budget_stop_the_run_with_a_checkpoint(run_recipe, monkeypatch, tmp_path):
    built = _wrap_parts(monkeypatch, lambda t: PoisonedUpdates(t, step=1, times=10**6))
    with pytest.raises(TrainStepFailed, match=r"RL step 1 failed 3 times .*max_train_step_retries=2.*"
                                              r"FloatingPointError"):
        run_recipe(*SMALL, "grpo.max_num_steps=3", "async_rl.failure.max_train_step_retries=2",
                   "checkpoint.save_every_steps=0", name="retry_spent")
    tr = built["trainer"]
    assert tr.finish_calls == {0: 1, 1: 3}  # one try and two retries, not one retry
    # the trainer step is closed: a new step can begin (begin() refuses while one is open)
    assert tr.inner._loss is None
    tr.inner.begin(object())
    tr.inner.abort()
    # checkpoint-on-failure: the last good state (RL step 1, the failed step's groups back as ready)
    ck = newest_complete(tmp_path / "retry_spent" / "steps")
    assert ck is not None and ck.name == "step_000001"
    loaded = load_run_checkpoint(ck, restore_rng=False)
    assert loaded.rl_step == 1 and int(loaded.trainer_state["version"]) == 1
    ready = loaded.controller_state["buffer"]["ready"]
    assert len([r for r in ready if r["target_step"] == 1]) == 4  # the whole failed step is back


def test_logprob_critic_value_and_critic_update_failures_are_retried(run_recipe, monkeypatch):
    # PPO with a critic, two epochs (previous-policy logprobs) and a KL term in the reward
    # (reference logprobs): each pass fails once and is retried
    built = _wrap_parts(monkeypatch, lambda t: PoisonedUpdates(t, fail_logprobs={True: 1, False: 1}), FlakyCritic)
    summary, run_dir = run_recipe(*SMALL, "grpo.max_num_steps=2", "grpo.ppo_epochs=2", "critic.enabled=true",
                                  "advantage.estimator=gae", "advantage.kl_in_reward_coef=0.01",
                                  "async_rl.failure.max_train_step_retries=1", name="retry_passes")
    tr, critic = built["trainer"], built["critic"]
    assert summary["rl_steps"] == 2
    assert tr.logprob_failures == 2 and tr.fail_logprobs == {True: 0, False: 0}
    assert critic.values_failed == 1 and critic.updates_poisoned == 1
    recs = _train_records(run_dir)
    assert recs[-1]["train/pass_retries_total"] == 4.0 and recs[-1]["train/step_retries_total"] == 4.0
    assert tr.inner._loss is None and critic.inner._loss is None


def test_a_pass_failing_beyond_the_budget_stops_the_run_with_a_checkpoint(run_recipe, monkeypatch, tmp_path):
    built = _wrap_parts(monkeypatch, lambda t: PoisonedUpdates(t, fail_logprobs={False: 10**6}))
    with pytest.raises(TrainStepFailed, match="previous-policy logprobs of RL step 0 failed 3 times"):
        run_recipe(*SMALL, "grpo.max_num_steps=2", "grpo.ppo_epochs=2", "async_rl.failure.max_train_step_retries=2",
                   "checkpoint.save_every_steps=0", name="pass_spent")
    tr = built["trainer"]
    assert tr.logprob_failures == 3 and tr.inner._loss is None and tr.finish_calls == {}
    ck = newest_complete(tmp_path / "pass_spent" / "steps")
    assert ck is not None and load_run_checkpoint(ck, restore_rng=False).rl_step == 0


def test_a_ppo_mini_step_failing_beyond_the_budget_checkpoints_the_open_step(run_recipe, monkeypatch, tmp_path):
    # two mini-steps per RL step; the second update of RL step 1 keeps failing. The first one has
    # already moved the policy, so the checkpoint holds step 1 open after it, and the resumed run
    # continues at the second mini-step: no update is applied twice
    real = launch_train.build_parts
    built = _wrap_parts(monkeypatch, lambda t: PoisonedUpdates(t, step=1, times=10**6, skip=1))
    overrides = [*SMALL, "grpo.max_num_steps=3", "grpo.ppo_epochs=2", "async_rl.failure.max_train_step_retries=1",
                 "checkpoint.save_every_steps=0"]
    with pytest.raises(TrainStepFailed, match="RL step 1 failed 2 times"):
        run_recipe(*overrides, name="ppo_spent")
    tr = built["trainer"]
    assert tr.finish_calls == {0: 2, 1: 3} and tr.inner.optimizer_steps == 3 and tr.inner._loss is None
    ck = newest_complete(tmp_path / "ppo_spent" / "steps")
    loaded = load_run_checkpoint(ck, restore_rng=False)
    assert loaded.rl_step == 1 and int(loaded.trainer_state["optimizer_steps"]) == 3
    open_step = loaded.controller_state["open_step"]
    assert open_step.step == 1 and open_step.next_ministep == 1 and len(open_step.trained) == 4
    assert not [r for r in loaded.controller_state["buffer"]["ready"] if r["target_step"] == 1]
    # the same command again, without the fault, resumes from that checkpoint
    monkeypatch.setattr(launch_train, "build_parts", real)
    cfg = load_recipe(RECIPE, [f"output_dir={tmp_path}", "run_name=ppo_spent", "logging.tensorboard=false",
                               *overrides])
    summary = launch_train.train_from_recipe(cfg)
    assert summary["rl_steps"] == 3 and summary["optimizer_steps"] == 6  # 2 per RL step, none twice
