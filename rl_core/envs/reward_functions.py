"""`env.type: reward_functions`: rewards from plain Python functions named by import path.

Owns: importing and checking the functions (`load_reward_functions`: importable callables
taking `(prompt, completion, example)`; the recipe's preflight, rl_core.launch.preflight,
calls it so a bad target stops `rl-core validate` before any model is built) and the
environment that calls them.

The contract of a reward function (docs/environments.md):
    fn(prompt, completion, example) -> float
- `prompt`: the prompt as the model saw it before templating: the text (`str`), or with
  `use_chat_template` the chat messages (`list[dict]` with `role` and `content`);
- `completion`: the completion text, end token removed;
- `example`: the example's fields (every column of the data row, plus `prompt`, `answer`,
  `messages` as mapped by `data.prompt_key` / `answer_key` / `messages_key`); a copy, so a
  function cannot change what the next one sees.
It returns a real number (an int or a bool counts as its value); anything else, or NaN or
infinity, is an error naming the function. Each function is a named reward component
(`reward_names`: the names, `EnvResult.rewards`: the raw values); the reward is
`sum(weight_i * value_i)`. GDPO (`advantage.estimator: gdpo`) normalises each component per
group and weights them with `advantage.reward_weights` (default: 1 each).

Errors: a function that raises (or returns a non-number) raises `RewardFunctionError`,
naming the function, from the environment's `score`; the rollout pump treats it like any
environment error (a *data* failure under the resilience policy: the group is retried up to
`rollout.failure.max_data_attempts` and then dropped within the drop budget, see
rl_core/resilience.py). A truncated completion (finish reason "length") is scored like any
other; an aborted one is not scored (BaseEnv: reward 0, masked out).

Does not own: templating and end tokens (base.py), the advantage (rl_core.algorithms).
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

from rl_core.envs import register_env
from rl_core.envs.base import BaseEnv, Completion
from rl_core.errors import RecipeError
from rl_core.plugins import load_target
from rl_core.types import EnvResult


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
        out.append(RewardFunction(spec.name or spec.target.split(":")[1], spec.target, float(spec.weight), fn))
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
            if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                raise RewardFunctionError(f"reward function {f.name} ({f.target}) returned {value!r} "
                                          f"({type(value).__name__}); it must return a finite float")
            values[f.name] = float(value)
        total = sum(f.weight * values[f.name] for f in self.functions)
        return EnvResult(reward=total, rewards=values, info={"ended": completion.ended})
