"""The addition environment: reward 1 for the exact reversed-digit sum followed by the end token.

Owns the scoring rule of the toy task (`rl_core.data.addition` makes its data):
- the observation is the raw prompt text (`"07+45="`), encoded without special tokens and
  without a chat template: the tiny model is not a chat model;
- a completion is *correct* when its text, end token removed, equals the example's
  `answer` exactly (no whitespace, no extra digits) and the sample ended on the end token
  (finish reason "stop"); a truncated sample is never correct;
- with `env.format_reward > 0`, a *well-formed* completion (exactly as many ASCII digits
  as the expected answer, then the end token) earns that bonus whatever its value;
- `digits` is partial credit: the share of answer digits right, position by position
  (0 unless the sample ended), added with weight `env.digit_reward`; so
  `reward = correct + format_reward * well_formed + digit_reward * digits`.

`EnvResult.rewards` carries the components (`correct`, `format`, `digits`) for multi-reward
algorithms and metrics; `info` carries the booleans.

Does not own: the prompt format or the answer encoding (the data generator), templating
machinery and end-token handling (`base.py`).
"""

from __future__ import annotations

from typing import Any

from rl_core.envs import register_env
from rl_core.envs.base import BaseEnv, Completion
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
        answer = str(example["answer"])
        text = completion.text
        well_formed = (completion.ended and len(text) == len(answer)
                       and text.isascii() and text.isdigit())
        correct = completion.ended and text == answer
        fmt = self.format_reward if well_formed else 0.0
        # partial credit: the share of answer digits right, position by position (a denser signal)
        digits = sum(a == b for a, b in zip(text, answer)) / len(answer) if completion.ended and answer else 0.0
        return EnvResult(
            reward=float(correct) + fmt + self.digit_reward * digits,
            rewards={"correct": float(correct), "format": fmt, "digits": digits},
            info={"correct": correct, "well_formed": well_formed},
        )
