"""Agent episodes through the `EpisodeEnvironment` seam (issue 40, "Agents"): the rollout owns
the session server (the controller builds one per run, the episodes open their sessions on
it, it is stopped at the end), an environment only runs its agent against the URL and key it
is given; `env.type: http` is built through `AgentEnv.__init__`; the agent function is
imported and checked once per process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from rl_core.launch.preflight import load_recipe
from rl_core.controller.controller import Controller
from rl_core.envs import agent as agent_module
from rl_core.envs.agent import AgentEnv, HttpServiceEnv
from rl_core.protocols import Environment, EpisodeEnvironment
from rl_core.rollout.group import GroupOptions, generate_group
from rl_core.types import EnvResult, SamplingParams
from tests.helpers.fakes import FakeBackend, FakeChatTokenizer, FakeEnv, make_parts
from tests.helpers.recipes import controller_recipe
from tests.helpers.user_code import user_module

ROOT = Path(__file__).resolve().parents[2]


class OneCallAgentEnv(FakeEnv):
    """An episode environment whose agent makes one `/completions` call through its session and
    is rewarded by the completion's length; it records the URLs it was given."""

    runs_episodes = True
    episode_timeout_s = 30.0

    def __init__(self):
        self.urls: list[str] = []
        self.completions: list[list[int]] = []

    async def run_agent(self, base_url, api_key, example):
        self.urls.append(base_url)
        async with httpx.AsyncClient() as client:
            r = await client.post(f"{base_url}/completions", headers={"Authorization": f"Bearer {api_key}"},
                                  json={"prompt": self.prompt_ids(example), "max_tokens": 4})
        r.raise_for_status()
        ids = r.json()["choices"][0]["token_ids"]
        self.completions.append(ids)
        return EnvResult(reward=float(len(ids) % 2), rewards={"r": float(len(ids) % 2)})


def test_the_controller_runs_episodes_on_the_session_server_it_owns(tmp_path):
    cfg = controller_recipe(grpo={"max_num_steps": 2})
    parts = make_parts(cfg, backend=FakeBackend(seed=3))
    env = parts.env = OneCallAgentEnv()
    assert isinstance(env, EpisodeEnvironment) and isinstance(env, Environment)
    ctl = Controller(cfg, parts, tmp_path, total_steps=2)
    records = []
    ctl.step_observers.append(records.append)
    summary = asyncio.run(asyncio.wait_for(ctl.run(), 60))
    assert summary["rl_steps"] == 2
    server = ctl.sessions
    assert server is not None and server.registry.episodes == len(env.urls) > 0
    assert all(u.startswith(f"http://127.0.0.1:{server.port}/sessions/") for u in env.urls)
    # every trained sample is the one model call its agent made, token for token
    trained = [list(s.completion_ids) for r in records for t in r.trained for s in t.group.samples]
    assert trained and all(ids in env.completions for ids in trained)
    with pytest.raises(httpx.TransportError):  # stopped with the run
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=2)


def test_an_episode_needs_the_runs_session_server():
    async def main():
        await generate_group(FakeBackend(), OneCallAgentEnv(), None, {"id": 1}, [1, 2], 2,
                             SamplingParams(max_tokens=4), "g", (0, 0, 1), GroupOptions())

    with pytest.raises(RuntimeError, match="GroupOptions.sessions"):
        asyncio.run(main())


def test_http_service_env_is_built_through_agent_env(monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe's data files
    cfg = load_recipe("recipes/tiny-addition.yaml", ["env.type=http", "env.url=http://127.0.0.1:8765",
                                                    "env.reward_names=[a,b]", "env.episode_timeout_s=7",
                                                    "env.system_prompt=be brief"])
    env = HttpServiceEnv(cfg.env, FakeChatTokenizer())
    assert (env.agent, env.kwargs, env.episode_timeout_s, env.reward_names, env.system_prompt) == \
        (None, {}, 7.0, ("a", "b"), "be brief")
    assert env.end_token_ids == (2, 0) and env.url == "http://127.0.0.1:8765"
    assert isinstance(env, EpisodeEnvironment) and isinstance(env, Environment)


def test_the_agent_function_is_imported_and_checked_once(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe's data files
    calls = []
    real = agent_module.load_target

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(agent_module, "load_target", counting)
    with user_module(tmp_path, monkeypatch, "once_agents", "async def agent(client, example, turns=2):\n"
                                                           "    return 1.0\n"):
        cfg = load_recipe("recipes/tiny-addition.yaml", ["env.type=agent", "env.target=once_agents:agent",
                                                        "env.kwargs={turns: 3}"])  # checked here, at load
        env = AgentEnv(cfg.env, FakeChatTokenizer())
    assert calls == ["once_agents:agent"] and env.agent.__name__ == "agent" and env.kwargs == {"turns": 3}
