"""Recipe-load checks of the environment section (`rl-core validate` and every command that
loads a recipe, before any model is built).

Owns: importing and checking what the `env` section names: a `custom` class
(`load_env_class`: a concrete class with the members of rl_core.protocols.Environment,
built as `Class(config, tokenizer)`), the `reward_functions` (`load_reward_functions`:
callables taking `(prompt, completion, example)`), a `reasoning_gym` task and its config;
and the data/env pairing (`data.messages_key` needs a chat-template environment; data
without answers needs an environment and a model that use none). Every failure is one
RecipeError paragraph naming the field. torch-free (the environments live in rl_core.envs).

Does not own: building the environments (rl_core.envs.custom, rl_core.envs.reward_functions).

Read more: docs/environments.md, "Errors".
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from rl_core.errors import RecipeError
from rl_core.plugins import load_target

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


@dataclass(frozen=True)
class RewardFunction:
    """One loaded `env.functions[i]`."""

    name: str
    target: str
    weight: float
    fn: Callable[..., Any]


def load_reward_functions(specs: list[Any]) -> list[RewardFunction]:
    """Import and check every `env.functions[i]` (a RecipeError naming `env.functions[i].target`)."""
    out = []
    for i, spec in enumerate(specs):
        field = f"env.functions[{i}].target"
        fn = load_target(spec.target, field=field, kind="callable")
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            sig = None
        if sig is not None:
            try:
                sig.bind(None, "", {})
            except TypeError:
                raise RecipeError.single(field, spec.target, f"a function called as fn(prompt, completion, example) "
                                         f"(its signature is {sig})",
                                         "give the function the three parameters (prompt, completion, example) "
                                         "and return a float.") from None
        out.append(RewardFunction(spec.component, spec.target, float(spec.weight), fn))
    return out


def check_env_config(cfg: Any, source: str | None = None) -> None:
    env = cfg.env
    try:
        if env.type == "custom":
            load_env_class(env.target)
        elif env.type == "reward_functions":
            load_reward_functions(list(env.functions))
        elif env.type == "reasoning_gym":
            from rl_core.data.reasoning_gym import task_dataset

            task_dataset(env.task, dict(env.config))
    except RecipeError as exc:
        raise RecipeError(exc.problems, source) from None
    if cfg.data.answer_key is None:
        if env.type in ("addition", "chain_addition", "reasoning_gym"):
            raise RecipeError.single("data.answer_key", None, f"a column of reference answers (env.type {env.type} "
                                     f"scores against the example's answer)",
                                     "set data.answer_key to the answer column (default: answer).", source)
        if cfg.model.source == "tiny":
            raise RecipeError.single("data.answer_key", None, "a column of reference answers with model.source tiny "
                                     "(its tokenizer, length check and warm-up use the answers)",
                                     "set data.answer_key, or use a pretrained model (model.source: hf).", source)
    if cfg.data.messages_key and env.type in ("addition", "chain_addition", "reward_functions", "reasoning_gym") \
            and not getattr(env, "use_chat_template", False):
        fix = ("set env.use_chat_template: true" if env.type in ("reward_functions", "reasoning_gym")
               else "use an environment that renders chats (reward_functions, reasoning_gym or custom)")
        raise RecipeError.single("data.messages_key", cfg.data.messages_key,
                                 f"an environment that renders chat prompts with the tokenizer's chat template "
                                 f"(env.type {env.type} does not here)",
                                 f"{fix}, or map a text column with data.prompt_key.", source)
