"""`env.type: agent` / `http`: an agent program or a service drives each episode over the OpenAI API.

Owns: loading and checking the agent function once (`env.target`, an async function
`agent(client, example, **kwargs)`: `load_agent`), running one episode (`run_agent`, the
`protocols.EpisodeEnvironment` seam: an `openai.AsyncOpenAI` client, `openai_client.AgentClient`,
bound to the session URL it is given, no client-side retries, since a retried call would be a second model turn; or a
POST to the environment service) and turning what comes back into an `EnvResult`: a float is
the reward, a dict of floats named components (matching `env.reward_names`) summed;
`env.success` sets `info["correct"]`. `prompt_ids` is what the warm-up trains on.

Does not own: the rollout and the session server the episode's URL points at
(rl_core.rollout.group.generate_episode, rl_core.rollout.session_server). Guide: docs/agents.md.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from rl_core.envs.base import BaseEnv, Completion, register_env
from rl_core.errors import RecipeError
from rl_core.plugins import load_target
from rl_core.types import REWARD_EXPECTED, EnvResult, is_reward
from rl_core.usercode import UserLoop


class AgentError(RuntimeError):
    """The agent function failed or returned something that is not a reward (a data failure of its group)."""


_CHECKED: dict[tuple[str, tuple[str, ...]], Any] = {}  # (target, kwarg names) -> the checked agent


def load_agent(env_config: Any):
    """Import `env.target` and check it is an async function taking `env.kwargs` (at recipe
    load, before any build); once per process: the environment built later gets the same
    function without importing or checking it again."""
    key = (env_config.target, tuple(sorted(env_config.kwargs)))
    if key in _CHECKED:
        return _CHECKED[key]
    fn = load_target(env_config.target, field="env.target", kind="callable")
    if not inspect.iscoroutinefunction(fn):
        raise RecipeError.single("env.target", env_config.target, "an async function `async def agent(client, example, "
                                 "**kwargs)`", "declare the agent with `async def` (it awaits the client's calls).")
    params = inspect.signature(fn).parameters
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_var = any(p.kind == p.VAR_KEYWORD for p in params.values())
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params.values()):
        raise RecipeError.single("env.target", env_config.target, "a function taking (client, example, **kwargs)",
                                 "give the agent two positional parameters: the OpenAI client and the example.")
    unknown = [k for k in env_config.kwargs if k not in params and not takes_var]
    if unknown:
        raise RecipeError.single("env.kwargs", dict(env_config.kwargs),
                                 f"keyword arguments {env_config.target} accepts (it has no {', '.join(unknown)})",
                                 "fix env.kwargs to match the agent function's parameters.")
    _CHECKED[key] = fn
    return fn


@register_env("agent")
class AgentEnv(BaseEnv):
    """An `EpisodeEnvironment`: the agent function `env.target` drives each episode."""

    name = "agent"
    use_chat_template = True
    runs_episodes = True

    def __init__(self, config: Any, tokenizer: Any):
        super().__init__(config, tokenizer)
        self.system_prompt = config.system_prompt
        self.reward_names = tuple(config.reward_names)
        self._first_names: list[str] | None = None  # the components of the first episode's rewards
        self.episode_timeout_s = config.episode_timeout_s
        self.agent, self.kwargs = self._program(config)
        self._http = None
        self._loop: UserLoop | None = None  # the agents' event loop, started at the first episode
        self._local = None  # the agents' client over the session server's in-process transport
        self._local_transport = None
        self._platform = None  # what the first episode's openai client resolved (see _episode)

    def _program(self, config: Any) -> tuple[Any, dict[str, Any]]:
        """The agent function and its keyword arguments (checked at recipe load: `load_agent`)."""
        return load_agent(config), dict(config.kwargs)

    @property
    def agent_name(self) -> str:
        """The agent as errors name it: `agent <env.target>`, or `environment service <env.url>`."""
        target = getattr(self.config, "target", None)
        return f"agent {target}" if target else f"environment service {self.config.url}"

    def http(self):
        """The environment's HTTP client (made on first use in the running loop): its agents'
        OpenAI clients share its connections."""
        if self._http is None:
            import httpx

            from rl_core.generation.http.fleet import CLIENT_KEEPALIVE_S

            self._http = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None,
                                                                             max_keepalive_connections=256,
                                                                             keepalive_expiry=CLIENT_KEEPALIVE_S))
        return self._http

    def attach_session_transport(self, transport: Any) -> None:
        """The session server's in-process transport (`SessionServer.transport`, or None): the
        agents' OpenAI clients send their calls through it, straight to the server's routes, with
        no socket between them (rl_core.rollout.group.generate_episode attaches it)."""
        if transport is not self._local_transport:
            self._local_transport = transport
            self._local = None  # the client of the last transport closes with the run (aclose)
            if transport is not None:
                self._local = transport.client()

    def agent_http(self):
        """The HTTP client of the agents' OpenAI clients: the session server's in-process transport
        when attached, else the environment's network client (`http`)."""
        return self._local if self._local is not None else self.http()

    async def aclose(self) -> None:
        if self._loop is not None:  # the client lives on the agents' loop (given up on if user code blocks it)
            await self._loop.run_within(self._close_http(), 5.0)
            self._loop.close()
            self._loop = None
        else:
            await self._close_http()

    async def _close_http(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._local is not None:
            await self._local.aclose()
            self._local = self._local_transport = None
        if self._local is not None:
            await self._local.aclose()
            self._local = self._local_transport = None

    # ------------------------------------------------------------------ one episode

    async def run_agent(self, base_url: str, api_key: str, example: dict[str, Any]) -> EnvResult:
        """Run the agent on one example against the session at `base_url`; its reward(s). Agents
        run on an event loop of their own (`usercode.UserLoop`): one that blocks stops that loop,
        never the controller's, and the watchdog names it."""
        if self._loop is None:
            self._loop = UserLoop(self.agent_name)
        return await self._loop.run(self._episode(base_url, api_key, example))

    async def _episode(self, base_url: str, api_key: str, example: dict[str, Any]) -> EnvResult:
        import openai

        from rl_core.envs.openai_client import AgentClient

        # a real openai.AsyncOpenAI; its plain chat calls skip openai's body transform (rl_core.envs.openai_client)
        client = AgentClient(base_url=base_url, api_key=api_key, max_retries=0, http_client=self.agent_http())
        # a new client resolves its platform headers in a worker thread at its first call (openai's
        # `_platform`, the same for every client of this process): a thread round trip an
        # episode, unless it is handed what an earlier episode's client resolved
        if self._platform is not None and getattr(client, "_platform", False) is None:
            client._platform = self._platform
        try:
            out = await self.agent(client, dict(example), **self.kwargs)
        except asyncio.CancelledError:
            raise
        except openai.APIStatusError as exc:
            raise AgentError(f"agent {self.config.target}: a model call was refused (HTTP {exc.status_code}): "
                             f"{exc.message}") from exc
        except openai.APIConnectionError as exc:
            raise ConnectionError(f"agent {self.config.target}: a model call failed: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - the agent's own failure: a data failure of the group
            raise AgentError(f"agent {self.config.target} raised {type(exc).__name__}: {exc}") from exc
        finally:
            self._platform = self._platform or getattr(client, "_platform", None)
        return self.to_result(out)

    def to_result(self, out: Any) -> EnvResult:
        """The episode's `EnvResult` from what the agent (or service) returned, with `info["correct"]`
        set by `env.success` where the recipe gives one."""
        result = self._result(out)
        names = sorted(result.rewards)
        if names and self.reward_names and not set(names) <= set(self.reward_names):
            raise AgentError(f"{self.agent_name} returned reward components {names}; env.reward_names says "
                             f"{sorted(self.reward_names)}. Fix: return only the components env.reward_names lists")
        if names and not self.reward_names:  # every episode returns the first named components
            if self._first_names is None:
                self._first_names = names
            elif names != self._first_names:
                raise AgentError(f"{self.agent_name} returned reward components {names}; an earlier episode returned "
                                 f"{self._first_names}. Fix: return the same named components from every episode "
                                 "(list them in env.reward_names)")
        success = getattr(self.config, "success", None)
        if success is not None:
            if success.component is not None and success.component not in result.rewards:
                raise AgentError(f"{self.agent_name} returned no reward component {success.component!r}, which "
                                 f"env.success.component names (it returned {sorted(result.rewards) or 'one float'})")
            result.info["correct"] = success.passes(result.reward, result.rewards)
        return result

    def _result(self, out: Any) -> EnvResult:
        target = self.agent_name
        if isinstance(out, EnvResult):
            return out
        if isinstance(out, bool) or not isinstance(out, (int, float, dict)):
            raise AgentError(f"{target} returned {type(out).__name__}; expected a float reward or a dict of "
                             "named float rewards")
        if isinstance(out, dict):
            if self.reward_names and sorted(out) != sorted(self.reward_names):
                raise AgentError(f"{target} returned rewards {sorted(out)}; env.reward_names says "
                                 f"{sorted(self.reward_names)}")
            bad = [k for k, v in out.items() if isinstance(v, bool) or not is_reward(v)]
            if bad:
                raise AgentError(f"{target} returned non-numeric or non-finite rewards (in float32) for {bad}; "
                                 f"expected {REWARD_EXPECTED}")
            rewards = {str(k): float(v) for k, v in out.items()}
            if not is_reward(sum(rewards.values())):
                raise AgentError(f"{target} returned rewards {rewards} whose sum leaves float32's range")
            return EnvResult(reward=sum(rewards.values()), rewards=rewards)
        if not is_reward(out):
            raise AgentError(f"{target} returned a non-finite reward (in float32) {out!r}; expected {REWARD_EXPECTED}")
        return EnvResult(reward=float(out))

    def score_completion(self, example: dict[str, Any], completion: Completion) -> EnvResult:
        raise AgentError("an agent environment is scored by its agent, per episode (rl_core.rollout.group."
                         "generate_episode), not completion by completion")


@register_env("http")
class HttpServiceEnv(AgentEnv):
    """`env.type: http`: each episode is `POST {env.url}/episodes` to an environment service,
    which runs the episode against the session URL it is given (docs/agents.md has the protocol).
    With `env.command` rl_core starts the service (at build, so its start overlaps model
    loading), waits for `GET /health` before the first episode, and stops it at the end."""

    name = "http"
    attach_session_transport = None  # the service, in its own process, calls the session server's socket

    def __init__(self, config: Any, tokenizer: Any):
        super().__init__(config, tokenizer)
        self.url = config.url.rstrip("/")
        self._healthy = False
        self.process = None
        if config.command:  # stops with this process, whatever ends it (rl_core.envs.service)
            from rl_core.envs.service import ServiceProcess

            self.process = ServiceProcess(list(config.command), self.url)

    def _program(self, config: Any) -> tuple[Any, dict[str, Any]]:
        return None, {}  # the service runs the episode

    async def _wait_healthy(self) -> None:
        import time

        import httpx

        deadline = time.monotonic() + self.config.startup_timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RecipeError.single("env.command", list(self.config.command),
                                         f"a command that keeps the service running (it exited with status "
                                         f"{self.process.returncode})", "run the command by hand to see its error.")
            try:
                r = await self.http().get(f"{self.url}/health", timeout=5.0)
                if r.status_code == 200:
                    self._healthy = True
                    return
                last = f"HTTP {r.status_code}"
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}"
            await asyncio.sleep(0.2)
        raise ConnectionError(f"environment service {self.url} did not answer GET /health with 200 within "
                              f"env.startup_timeout_s={self.config.startup_timeout_s} s (last: {last})")

    async def run_agent(self, base_url: str, api_key: str, example: dict[str, Any]) -> EnvResult:
        import httpx

        if not self._healthy:
            await self._wait_healthy()
        body = {"example": dict(example), "base_url": base_url, "api_key": api_key,
                "episode_id": base_url.rstrip("/").rsplit("/", 2)[-2]}
        try:
            r = await self.http().post(f"{self.url}/episodes", json=body, timeout=self.episode_timeout_s)
        except httpx.TransportError as exc:
            raise ConnectionError(f"environment service {self.url}: {type(exc).__name__}: {exc}") from exc
        if r.status_code >= 500 or r.status_code in (408, 429):
            raise ConnectionError(f"environment service {self.url} answered HTTP {r.status_code}: {r.text[:300]}")
        if r.status_code != 200:
            raise AgentError(f"environment service {self.url} refused the episode (HTTP {r.status_code}): "
                             f"{r.text[:300]}")
        try:
            data = r.json()
        except ValueError:
            raise AgentError(f"environment service {self.url} answered a body that is not JSON: {r.text[:200]!r}") \
                from None
        if not isinstance(data, dict) or ("reward" in data) == ("rewards" in data):
            raise AgentError(f"environment service {self.url} answered {str(data)[:200]}; expected a JSON object "
                             "with either \"reward\" (a number) or \"rewards\" (named numbers)")
        return self.to_result(data["reward"] if "reward" in data else data["rewards"])

    async def aclose(self) -> None:
        await super().aclose()
        if self.process is not None:  # only the processes rl_core started
            await asyncio.to_thread(self.process.stop)
        self.process = None
