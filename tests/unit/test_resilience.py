"""The retry policy of prompt groups (rl_core.resilience), on real exceptions and the real
clock: the time budget of infrastructure retries, the backoff capped by it, data failures
that exhaust at once, the paragraph that stops a run naming the user's file and line, and
the console notices of retries (rl_core.metrics.progress)."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import time

import pytest

from rl_core.launch.preflight import load_recipe
from rl_core.config.controller_sections import RolloutFailureConfig
from rl_core.errors import RecipeError, UserError, user_frame
from rl_core.metrics.progress import Progress
from rl_core.resilience import Attempts, FailureKind, GroupDropped, group_failed, retrying, with_deadline
from rl_core.rollout.group import generate_group
from tests.helpers.paths import TINY_RECIPE

USER_CODE = '''
def score(example):
    return 1 / example["zero"]
'''


def _user_module(tmp_path):
    path = tmp_path / "user_scoring.py"
    path.write_text(USER_CODE)
    spec = importlib.util.spec_from_file_location("user_scoring", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, path


def _raised_through_a_wrapper(mod) -> RuntimeError:
    try:
        try:
            mod.score({"zero": 0})
        except ZeroDivisionError as exc:
            raise RuntimeError("reward function score (user_scoring:score) raised ZeroDivisionError") from exc
    except RuntimeError as wrapped:
        return wrapped


def test_the_default_budget_is_time_not_a_count():
    f = RolloutFailureConfig()
    a = Attempts.of(f)
    assert (a.max_infra, a.infra_budget_s) == (None, f.infra_retry_budget_s) and f.infra_retry_budget_s >= 10
    with pytest.raises(RecipeError, match="field `async_rl.failure.infra_retry_budget_s` got None"):
        load_recipe(TINY_RECIPE, ["async_rl.failure.infra_retry_budget_s=null"])  # nothing would bound the retries
    assert Attempts.of(RolloutFailureConfig(infra_retry_budget_s=None, max_infra_attempts_per_group=3)).max_infra == 3


def test_infra_retries_last_the_budget_and_back_off_within_it():
    a = Attempts(None, 1, infra_budget_s=0.3)
    a.record(ConnectionRefusedError("down"))
    assert not a.exhausted and a.backoff(0.2, 2.0) == pytest.approx(0.2, abs=0.01)
    a.record(ConnectionRefusedError("down"))
    wait = a.backoff(0.2, 2.0)  # 0.4 by the doubling, but only what is left of the 0.3 s budget
    assert 0.2 < wait <= 0.3
    time.sleep(wait)
    a.record(ConnectionRefusedError("down"))
    assert a.exhausted and a.infra == 3 and a.last_kind is FailureKind.INFRA
    assert "3 infra attempts over 0.3 s" in a.counts()


def test_retrying_outlasts_an_outage_shorter_than_the_budget():
    back_at = time.monotonic() + 0.5
    told = []

    async def call():
        if time.monotonic() < back_at:
            raise ConnectionResetError("service restarting")
        return "ok"

    a = Attempts(None, 1, infra_budget_s=5.0)
    assert asyncio.run(retrying(call, a, 0.05, 0.2, lambda kind, exc: told.append(kind))) == "ok"
    assert a.infra >= 3 and told == [FailureKind.INFRA] * a.infra


def test_a_data_failure_is_not_retried_and_names_the_users_line(tmp_path):
    mod, path = _user_module(tmp_path)
    told = []

    async def call():
        raise _raised_through_a_wrapper(mod)

    a = Attempts(None, 1, infra_budget_s=5.0)
    with pytest.raises(RuntimeError, match="user_scoring:score"):
        asyncio.run(retrying(call, a, 0.05, 0.2, lambda kind, exc: told.append(kind)))
    assert told == [] and a.exhausted and a.data == 1
    assert a.last_frame == f"{path}:3 in score"
    err = group_failed("training prompt group e0-p7-d3 (example 7, epoch 0)", {"prompt": "1+2=", "answer": "3"}, a,
                       "async_rl.failure.max_dropped_groups=0 is spent")
    assert isinstance(err, GroupDropped) and isinstance(err, UserError)  # one paragraph, no traceback on the CLI
    text = str(err)
    assert text.startswith("RuntimeError: reward function score (user_scoring:score) raised ZeroDivisionError "
                           f"(at {path}:3 in score)")
    assert "{'prompt': '1+2=', 'answer': '3'}" in text and "1/1 data attempts" in text
    assert f"Fix: correct your code at {path}:3 in score" in text and "\n" not in text


def test_no_user_frame_in_rl_core_or_the_standard_library():
    async def failures():  # raised in rl_core's coroutines, run as tasks: no frame of this test in their tracebacks
        tasks = [asyncio.ensure_future(with_deadline(asyncio.sleep(1), 0.01, "generation of g/0")),
                 asyncio.ensure_future(generate_group(None, None, None, {}, [], 2, None, "g", (0,), seeds=[1]))]
        await asyncio.wait(tasks)
        return [t.exception() for t in tasks]

    timeout, bad_seeds = asyncio.run(failures())
    a = Attempts(None, 2, infra_budget_s=5.0)
    assert a.record(timeout) is FailureKind.INFRA and a.last_frame is None
    assert a.record(bad_seeds) is FailureKind.DATA and a.last_frame is None and user_frame(bad_seeds) is None
    assert "repair the cause named first" in str(group_failed("g", {}, a, "no drops"))


def test_notices_of_repeated_retries_are_rate_limited():
    out = io.StringIO()
    p = Progress(10, "log", stream=out)
    for _ in range(5):
        p.notice("training-infra", "[retry] training: infra failure", every_s=60)
    p.notice("validation start-infra", "[retry] validation start: infra failure", every_s=60)
    assert out.getvalue().splitlines() == ["[retry] training: infra failure", "[retry] validation start: infra failure"]
    p.notice("training-infra", "[retry] training: infra failure", every_s=0)
    assert out.getvalue().splitlines()[-1] == "[retry] training: infra failure (5 since the last such notice)"
