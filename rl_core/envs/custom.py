"""`env.type: custom`: a user's environment class, found by import path.

Owns: building the class named by `env.target` (`build_custom_env`, which `make_env` calls;
`load_env_class` in rl_core.config.env_plugins checks it at recipe load, so a bad target
stops `rl-core validate` before any model is built) as `Class(config, tokenizer)`: `config`
is the recipe's `env` section (`config.kwargs` the user's settings), `tokenizer` the policy's
HF tokenizer. The class is a `BaseEnv` subclass (hooks `prompt_text`, `messages`,
`score_completion`, `reference_text`, `observe`, `score_turns`) or any class that meets
`rl_core.protocols.Environment`; its module is found by `rl_core.plugins.load_target`.

Does not own: the Environment contract (rl_core.protocols) or the base class (base.py).

Read more: docs/environments.md, "Write an environment".
"""

from __future__ import annotations

from typing import Any

from rl_core.config.env_plugins import ENV_TARGET_FIELD, PROTOCOL_MEMBERS, load_env_class
from rl_core.errors import RecipeError

__all__ = ["build_custom_env", "load_env_class"]


def build_custom_env(config: Any, tokenizer: Any) -> Any:
    """Build the user class `Class(config, tokenizer)` and check the object against the protocol."""
    from rl_core.protocols import Environment

    cls = load_env_class(config.target)
    env = cls(config, tokenizer)
    if not isinstance(env, Environment):
        missing = [m for m in ("end_token_ids",) + PROTOCOL_MEMBERS if not hasattr(env, m)]
        raise RecipeError.single(ENV_TARGET_FIELD, config.target, f"an object meeting rl_core.protocols.Environment once built "
                                 f"(missing: {', '.join(missing)})",
                                 "set the missing attributes in the constructor (BaseEnv.__init__ sets end_token_ids).")
    return env
