"""The addition environment: reward 1 for the exact reversed-digit sum followed by the end token.

Owns the scoring rule of the toy task (`rl_core.data.addition` makes its data): the raw prompt
text as the observation (no special tokens, no chat template); `reward = correct +
format_reward * well_formed + digit_reward * digits`, where *correct* is the exact answer
followed by the end token (a truncated sample never is), *well formed* as many ASCII digits as
the answer then the end token, *digits* the share of answer digits right by position.
`EnvResult.rewards` carries the components (`correct`, `format`, `digits`), `info` the
booleans. A group generated in one call is scored in one call (`score_columns`): the answer
read once, each distinct completion text scored once, the columns built directly.

Does not own: the prompt format or the answer encoding (the data generator), templating
and end-token handling (`base.py`). Read more: docs/examples.md, "The toy task".
"""

from __future__ import annotations

import functools
import operator
from typing import Any

from rl_core.columns import GroupScores
from rl_core.envs import register_env
from rl_core.envs.base import BaseEnv, Completion, distinct_scored
from rl_core.types import EnvResult


@register_env("addition")
class AdditionEnv(BaseEnv):
    """Multi-digit addition with reversed-digit answers (config: `AdditionEnvConfig`)."""

    name = "addition"
    reward_names = ("correct", "format", "digits")

    def __init__(self, config: Any, tokenizer: Any):
        super().__init__(config, tokenizer)
        self.format_reward = float(config.format_reward)
        self.digit_reward = float(getattr(config, "digit_reward", 0.0))

    def score_completion(self, example: dict[str, Any], completion: Completion) -> EnvResult:
        correct, fmt, digits, reward, well_formed = self._scored(str(example["answer"]), completion.text,
                                                                 completion.ended)
        return EnvResult(
            reward=reward,
            rewards={"correct": float(correct), "format": fmt, "digits": digits},
            info={"correct": correct, "well_formed": well_formed},
        )

    def score_columns(self, example: dict[str, Any], texts: list[str], ended: list[bool],
                      finish_reasons: list[str]) -> GroupScores:
        """`score_completion` of a group's completions as columns: the answer read once per
        group, each distinct (text, ended) scored once (a group's samples often agree)."""
        answer = str(example["answer"])
        correct, fmt, digits, rewards, well_formed = distinct_scored(
            texts, ended, functools.partial(self._scored, answer), 5)
        return GroupScores(rewards, {"correct": list(map(float, correct)), "format": fmt, "digits": digits}, None,
                           {"correct": correct, "well_formed": well_formed})

    def _scored(self, answer: str, text: str, ended: bool) -> tuple[bool, float, float, float, bool]:
        """(correct, format reward, digits, reward, well_formed) of one completion's text."""
        well_formed = ended and len(text) == len(answer) and text.isascii() and text.isdigit()
        correct = ended and text == answer
        fmt = self.format_reward if well_formed else 0.0
        # partial credit: the share of answer digits right, position by position (a denser signal)
        # (`map(operator.eq, ...)` stops at the shorter string as `zip` does: the same count, no generator frames)
        digits = sum(map(operator.eq, text, answer)) / len(answer) if ended and answer else 0.0
        return correct, fmt, digits, float(correct) + fmt + self.digit_reward * digits, well_formed
