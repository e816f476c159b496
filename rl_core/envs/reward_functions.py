"""`env.type: reward_functions`: rewards from plain Python functions named by import path.

Owns: importing and checking the functions (`load_reward_functions`; rl_core.launch.preflight
calls it at recipe load) and the environment that calls them. Contract: `fn(prompt,
completion, example) -> float`, with the prompt before templating (text, or chat messages
with `use_chat_template`), the completion text without its end token, and a copy of the
example. A real number (bool and int count) is required; anything else, NaN or infinity, or
an exception raises `RewardFunctionError` naming the function (a *data* failure for the
rollout pump). Each function is a named component; `reward = sum(weight_i * value_i)`;
`env.success` decides correctness; GDPO normalises each component per group. Truncated
completions are scored like any other; aborted ones are not (BaseEnv: reward 0, masked).

Does not own: templating and end tokens (base.py), the advantage (rl_core.algorithms). Read
more: docs/environments.md, "Reward functions".
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from rl_core.envs import register_env
from rl_core.envs.base import BaseEnv, Completion
from rl_core.errors import RecipeError
from rl_core.plugins import load_target
from rl_core.types import REWARD_EXPECTED, EnvResult, is_reward


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
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)) \
                or inspect.isasyncgenfunction(fn):
            raise RecipeError.single(field, spec.target, "a plain function that returns a float (this one is "
                                     "`async def`: calling it returns a coroutine, not a number)",
                                     "define it with `def`, or use env.type: agent for work that awaits.")
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


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something that is not a number."""


@register_env("reward_functions")
class RewardFunctionsEnv(BaseEnv):
    """Single-turn environment whose reward is the weighted sum of user functions."""

    name = "reward_functions"

    def __init__(self, config: Any, tokenizer: Any):
        self.use_chat_template = bool(config.use_chat_template)
        self.system_prompt = config.system_prompt
        super().__init__(config, tokenizer)
        self.functions = load_reward_functions(list(config.functions))
        self.reward_names = tuple(f.name for f in self.functions)
        self.success = config.criterion()

    def prompt_for_functions(self, example: dict[str, Any]) -> str | list[dict[str, str]]:
        """What a function receives as `prompt`: the chat messages with the chat template, else the text."""
        return self.messages(example) if self.use_chat_template else self.prompt_text(example)

    def score_completion(self, example: dict[str, Any], completion: Completion) -> EnvResult:
        prompt = self.prompt_for_functions(example)
        values: dict[str, float] = {}
        for f in self.functions:
            try:
                value = f.fn(prompt if isinstance(prompt, str) else [dict(m) for m in prompt], completion.text,
                             dict(example))
            except Exception as exc:  # noqa: BLE001 - the user's function failed: an environment error naming it
                raise RewardFunctionError(f"reward function {f.name} ({f.target}) raised {type(exc).__name__}: "
                                          f"{exc}") from exc
            if isinstance(value, bool):
                value = float(value)
            if not is_reward(value):
                raise RewardFunctionError(f"reward function {f.name} ({f.target}) returned {value!r:.80} "
                                          f"({type(value).__name__}); expected {REWARD_EXPECTED}")
            values[f.name] = float(value)
        total = sum(f.weight * values[f.name] for f in self.functions)
        if not is_reward(total):
            raise RewardFunctionError(f"the weighted sum of the reward functions, {total!r}, leaves float32's range "
                                      f"(values {values}); lower the functions' values or env.functions[*].weight")
        return EnvResult(reward=total, rewards=values,
                         info={"ended": completion.ended, "correct": self.success.passes(total, values)})
