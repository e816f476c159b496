"""An example environment written outside rl_core (docs/environments.md walks through it).

`CloseEnoughEnv` scores the addition task's prompts (`"07+45="`, answer `"250"`: the reversed
digits of the sum) with partial credit: 1 for the exact answer, `kwargs.near_reward` when the
number is off by at most `kwargs.tolerance`, 0 otherwise. The recipe beside this file uses it:

    env:
      type: custom
      target: examples.custom_env.my_env:CloseEnoughEnv
      kwargs: {tolerance: 2, near_reward: 0.3}

The module is found like any import: run from the repository root (the working directory is
searched), or put its folder on PYTHONPATH and write `target: my_env:CloseEnoughEnv`.
"""

from __future__ import annotations

from typing import Any

from rl_core.envs.base import BaseEnv, Completion
from rl_core.types import EnvResult


class CloseEnoughEnv(BaseEnv):
    """Exact answer: 1; within `tolerance` of it: `near_reward`; the sample must end on the end token."""

    name = "close_enough"
    reward_names = ("exact", "near")

    def __init__(self, config: Any, tokenizer: Any):
        super().__init__(config, tokenizer)  # sets end tokens and the chat-template switch
        self.tolerance = int(config.kwargs.get("tolerance", 1))
        self.near_reward = float(config.kwargs.get("near_reward", 0.5))

    # prompt_text(example) is inherited: the example's "prompt" as raw text.

    def score_completion(self, example: dict[str, Any], completion: Completion) -> EnvResult:
        answer = str(example["answer"])
        text = completion.text.strip()
        exact = completion.ended and text == answer
        near = False
        if completion.ended and not exact and text.isdigit() and len(text) == len(answer):
            near = abs(int(text[::-1]) - int(answer[::-1])) <= self.tolerance  # answers are reversed digits
        reward = 1.0 if exact else (self.near_reward if near else 0.0)
        return EnvResult(reward=reward, rewards={"exact": float(exact), "near": float(near)},
                         info={"correct": exact})
