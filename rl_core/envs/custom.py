"""`env.type: custom`: a user's environment class, found by import path.

Owns: importing and checking the class named by `env.target` (`load_env_class`: importable,
concrete, with the members of rl_core.protocols.Environment; rl_core.launch.preflight calls it
so a bad target stops `rl-core validate` before any model is built) and building it
(`build_custom_env`, which `make_env` calls) as `Class(config, tokenizer)`: `config` is the
recipe's `env` section (`config.kwargs` the user's settings), `tokenizer` the policy's HF
tokenizer. The class is a `BaseEnv` subclass (hooks `prompt_text`, `messages`,
`score_completion`, `reference_text`, `observe`, `score_turns`) or any class that meets
`rl_core.protocols.Environment`; its module is found by `rl_core.plugins.load_target`.

Does not own: the Environment contract (rl_core.protocols) or the base class (base.py).

Read more: docs/environments.md, "Write an environment".
"""

from __future__ import annotations

import inspect
from typing import Any

from rl_core.errors import RecipeError
from rl_core.plugins import load_target

__all__ = ["build_custom_env", "load_env_class"]

ENV_TARGET_FIELD = "env.target"
PROTOCOL_MEMBERS = ("name", "reward_names", "max_turns", "prompt_ids", "stop_strings", "reference_completion_ids",
                    "parse_completion", "observe", "score", "score_turns", "runs_episodes", "aclose")
"""What an environment class itself must have (`end_token_ids` is an instance attribute: checked once built)."""


def load_env_class(target: str) -> type:
    """Import `module:Class` and check it against the Environment protocol (a RecipeError naming env.target)."""
    cls = load_target(target, field=ENV_TARGET_FIELD, kind="class", required=PROTOCOL_MEMBERS,
                      what="an environment class meeting rl_core.protocols.Environment",
                      hint="subclass rl_core.envs.base.BaseEnv and implement score_completion, or add the "
                           "missing members.")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise RecipeError.single(ENV_TARGET_FIELD, target, f"a concrete environment class (abstract methods left: "
                                 f"{missing})", f"implement {missing} in {cls.__name__}.")
    try:
        inspect.signature(cls).bind(object(), object())
    except TypeError:
        raise RecipeError.single(ENV_TARGET_FIELD, target, f"a class constructed as {cls.__name__}(config, tokenizer) "
                                 f"(its signature is {inspect.signature(cls)})",
                                 "give the constructor the parameters (config, tokenizer), like BaseEnv; "
                                 "read your settings from config.kwargs.") from None
    except ValueError:  # no signature to inspect (a C extension type): leave it to the build
        pass
    return cls


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
