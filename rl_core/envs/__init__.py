"""Environments: prompts in, rewards out; the registry here, one module per environment.

Owns the registry: `@register_env("addition")` on a class makes `make_env(env_config,
tokenizer)` build it for the recipe's `env.type: addition`; `ENVS` maps each type to its
class. Importing this package registers the built-in environments (`addition`,
`chain_addition`, `math`, `reasoning_gym`, `reward_functions`); `env.type: custom` is no registry entry:
`make_env` builds the user's class named by `env.target` (`rl_core.envs.custom`).
The base class every environment extends is `rl_core.envs.base.BaseEnv` (the contract:
`rl_core.protocols.Environment`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from rl_core.envs.base import BaseEnv

ENVS: dict[str, type[BaseEnv]] = {}


def register_env(type_name: str) -> Callable[[type[BaseEnv]], type[BaseEnv]]:
    """Class decorator: make `make_env` build this class for `env.type: <type_name>`."""

    def wrap(cls: type[BaseEnv]) -> type[BaseEnv]:
        if type_name in ENVS and ENVS[type_name] is not cls:
            raise ValueError(f"environment type {type_name!r} is already registered by "
                             f"{ENVS[type_name].__qualname__}")
        ENVS[type_name] = cls
        return cls

    return wrap


def registered_envs() -> tuple[str, ...]:
    """The environment types `make_env` knows, sorted (the registered ones and `custom`)."""
    return tuple(sorted([*ENVS, "custom"]))


def make_env(env_config: Any, tokenizer: Any) -> BaseEnv:
    """Build the environment registered under `env_config.type` for this tokenizer."""
    kind = getattr(env_config, "type", None)
    if kind == "custom":  # the user's class, named by env.target (not a registry entry)
        from rl_core.envs.custom import build_custom_env

        return build_custom_env(env_config, tokenizer)
    cls = ENVS.get(kind)
    if cls is None:
        from rl_core.errors import RecipeError

        raise RecipeError.single("env.type", kind, f"one of {', '.join(registered_envs())}",
                                 "pick a registered environment type.")
    return cls(env_config, tokenizer)


# the registry above must exist before the environment modules register themselves
from rl_core.envs.base import BaseEnv, Completion  # noqa: E402
from rl_core.envs.addition import AdditionEnv  # noqa: E402  (registers "addition")
from rl_core.envs.chain import ChainAdditionEnv  # noqa: E402  (registers "chain_addition")
from rl_core.envs.custom import build_custom_env  # noqa: E402  (env.type: custom)
from rl_core.envs.reasoning_gym import ReasoningGymEnv  # noqa: E402  (registers "reasoning_gym")
from rl_core.envs.reward_functions import RewardFunctionsEnv  # noqa: E402  (registers "reward_functions")
from rl_core.envs.math import MathEnv  # noqa: E402  (registers "math")
from rl_core.envs.agent import AgentEnv, HttpServiceEnv  # noqa: E402  (registers "agent", "http")

__all__ = ["AdditionEnv", "AgentEnv", "BaseEnv", "ChainAdditionEnv", "Completion", "ENVS", "HttpServiceEnv", "MathEnv",
           "ReasoningGymEnv", "RewardFunctionsEnv", "build_custom_env", "make_env", "register_env", "registered_envs"]
