"""Environments: prompts in, rewards out (`base` holds the registry, one module per task).

Importing this package registers the built-in environments, so `make_env` finds them.
"""

from rl_core.envs.base import BaseEnv, Completion, make_env, register_env, registered_envs
from rl_core.envs.addition import AdditionEnv  # noqa: E402  (registers "addition")
from rl_core.envs.chain import ChainAdditionEnv  # noqa: E402  (registers "chain_addition")

__all__ = ["AdditionEnv", "ChainAdditionEnv", "BaseEnv", "Completion", "make_env", "register_env", "registered_envs"]
