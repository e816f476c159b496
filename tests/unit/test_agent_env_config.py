"""`env.type: agent` and `env.type: http` as a user meets them before anything is built: the
agent function is imported and checked at recipe load, a service URL must be on this machine,
agent episodes cannot be reproducible; and what an agent may return."""

from __future__ import annotations

import math
import sys

import pytest

from rl_core.launch.preflight import load_recipe
from rl_core.envs.agent import AgentEnv, AgentError
from rl_core.errors import RecipeError
from tests.helpers.fakes import FakeChatTokenizer

ROOT_RECIPE = "tests/recipes/tiny-addition-loop.yaml"
AGENTS = '''
async def good(client, example, turns=2):
    return 1.0

def not_async(client, example):
    return 1.0

async def one_arg(client):
    return 1.0

not_callable = 3
'''


@pytest.fixture
def agents_module(tmp_path, monkeypatch):
    (tmp_path / "my_agents.py").write_text(AGENTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[2])
    yield "my_agents"
    sys.modules.pop("my_agents", None)


def _load(*overrides):
    return load_recipe(ROOT_RECIPE, list(overrides))


@pytest.mark.parametrize("target, kwargs, words", [
    ("no_such_module_zz:agent", "{}", ["env.target", "no_such_module_zz", "importable"]),
    ("my_agents:missing", "{}", ["env.target", "missing"]),
    ("my_agents:not_async", "{}", ["env.target", "async def"]),
    ("my_agents:one_arg", "{}", ["env.target", "(client, example"]),
    ("my_agents:not_callable", "{}", ["env.target", "a function"]),
    ("my_agents_no_colon", "{}", ["env.target", "module:Name"]),
    ("my_agents:good", "{tries: 3}", ["env.kwargs", "tries"]),
])
def test_bad_agent_targets_fail_at_recipe_load(agents_module, target, kwargs, words):
    with pytest.raises(RecipeError) as err:
        _load("env.type=agent", f"env.target={target}", f"env.kwargs={kwargs}")
    for w in words:
        assert w in str(err.value)


def test_a_good_agent_loads_and_reproducible_is_refused(agents_module):
    cfg = _load("env.type=agent", "env.target=my_agents:good", "env.kwargs={turns: 3}")
    assert cfg.env.target == "my_agents:good" and cfg.env.kwargs == {"turns": 3}
    with pytest.raises(RecipeError, match="async_rl.reproducible"):
        _load("env.type=agent", "env.target=my_agents:good", "async_rl.reproducible=true")


def test_http_service_must_be_on_this_machine():
    with pytest.raises(RecipeError, match="env.url"):
        _load("env.type=http", "env.url=http://10.1.2.3:8000")
    assert _load("env.type=http", "env.url=http://127.0.0.1:8765").env.command is None


def test_what_an_agent_may_return(agents_module):
    cfg = _load("env.type=agent", "env.target=my_agents:good", "env.reward_names=[a,b]")
    env = AgentEnv(cfg.env, FakeChatTokenizer())
    assert env.end_token_ids == (2, 0)
    r = env.to_result({"a": 0.5, "b": 0.25})
    assert r.reward == 0.75 and r.rewards == {"a": 0.5, "b": 0.25}
    for bad, words in [({"a": 1.0}, "reward_names"), ({"a": 1.0, "b": math.nan}, "non-finite"),
                       ("1.0", "expected a float"), (True, "expected a float"), ({"a": 1, "b": "x"}, "non-numeric")]:
        with pytest.raises(AgentError, match=words):
            env.to_result(bad)
    env.reward_names = ()
    assert env.to_result(2).reward == 2.0
    with pytest.raises(AgentError, match="non-finite"):
        env.to_result(math.inf)
