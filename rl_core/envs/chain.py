"""A multi-turn toy environment: chained addition over two turns.

Owns the episode: turn 1 is the addition prompt (`07+45=`, answer `250`: the reversed
3-digit sum); the environment then observes `+c=` (c derived from the example id, so it
is fixed per example) and turn 2 must answer a + b + c in the same reversed 3-digit
format. Reward = fraction of turns answered correctly; `info['correct']` = both correct.
The observation is the text `+c=` (`observation_text`); the base class turns it into tokens:
raw text for the tiny model (not a chat model), a chat user turn for a subclass that sets
`use_chat_template` (rl_core.envs.base.BaseEnv.observe).

Does not own: the multi-turn rollout loop (rl_core.rollout.group) or masking of
observation tokens (the loop marks them 0 in the sample's completion mask).
"""

from __future__ import annotations

from typing import Any

from rl_core.envs import register_env
from rl_core.envs.base import BaseEnv, Completion
from rl_core.types import EnvResult


def third_operand(example: dict[str, Any]) -> int:
    return (int(example.get("id", 0)) * 37 + 11) % 100


def reversed_answer(total: int) -> str:
    return f"{total:03d}"[::-1]


@register_env("chain_addition")
class ChainAdditionEnv(BaseEnv):
    name = "chain_addition"
    reward_names = ("turn1", "turn2")

    def __init__(self, config: Any, tokenizer: Any):
        super().__init__(config, tokenizer)
        self.max_turns = int(config.max_turns)

    def observation_text(self, example: dict[str, Any], turn: int, completion: Completion) -> str | None:
        if turn >= self.max_turns - 1:
            return None
        return f"+{third_operand(example):02d}="

    def _expected(self, example: dict[str, Any], turn: int) -> str:
        a, b = int(example["a"]), int(example["b"])
        return reversed_answer(a + b) if turn == 0 else reversed_answer(a + b + third_operand(example))

    def score_completion(self, example: dict[str, Any], completion: Completion) -> EnvResult:
        return self.score_turns(example, [completion])

    def score_turns(self, example: dict[str, Any], turns: list[Completion]) -> EnvResult:
        ok = [t.ended and t.text == self._expected(example, i) for i, t in enumerate(turns[:2])]
        ok += [False] * (self.max_turns - len(ok))
        rewards = {f"turn{i + 1}": float(c) for i, c in enumerate(ok)}
        return EnvResult(reward=sum(ok) / len(ok), rewards=rewards,
                         info={"correct": all(ok), "turns_correct": sum(ok)})
