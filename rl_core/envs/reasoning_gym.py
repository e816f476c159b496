"""`env.type: reasoning_gym`: a reasoning-gym task scored by the task's own scorer.

Owns the answer format and the scoring: the question, a blank line and `env.instruction` as
the observation (raw text or the chat template); the answer read from the completion
(`answer_tag`: between the *last* `<answer>` and its `</answer>`; `last_line`: the last
non-empty line); the score `dataset.score_answer(answer, entry)` of the task built from
`env.task` and `env.config` (entry = question, answer, metadata; in [0, 1], some partial);
`reward = score + format_reward * well_formed`, components `correct` and `format`,
`info['correct']` = score >= 1. A group generated in one call is scored in one call, each
distinct completion text once (the task's scorer is a function of the answer and entry).

Does not own: templating and end tokens (base.py) or the data (`rl-core make-data
reasoning_gym`). Read more: docs/environments.md, "reasoning_gym".
"""

from __future__ import annotations

import functools
import re
from typing import Any

from rl_core.columns import GroupScores
from rl_core.envs import register_env
from rl_core.envs.base import Completion, FinalAnswerEnv, distinct_scored
from rl_core.types import EnvResult

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str, answer_format: str = "answer_tag") -> str | None:
    """The answer in `text` per `answer_format` (see the module docstring), or None."""
    if answer_format == "answer_tag":
        found = _TAG.findall(text)
        return found[-1].strip() if found else None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else None


@register_env("reasoning_gym")
class ReasoningGymEnv(FinalAnswerEnv):
    """A reasoning-gym task scored by the task's own scorer (config: `ReasoningGymEnvConfig`)."""

    name = "reasoning_gym"

    def __init__(self, config: Any, tokenizer: Any):
        from rl_core.data.reasoning_gym import task_dataset

        super().__init__(config, tokenizer)
        self.task = config.task
        self.dataset = task_dataset(config.task, dict(config.config))

    def prompt_text(self, example: dict[str, Any]) -> str:
        question = super().prompt_text(example)
        return f"{question}\n\n{self.instruction}" if self.instruction else question

    def reference_text(self, example: dict[str, Any]) -> str:
        answer = str(example["answer"])
        return f"<answer>{answer}</answer>" if self.answer_format == "answer_tag" else answer

    def entry(self, example: dict[str, Any]) -> dict[str, Any]:
        """The reasoning-gym entry the scorer reads."""
        return {"question": example.get("prompt", ""), "answer": str(example["answer"]),
                "metadata": example.get("metadata") or {}}

    def score_answer(self, answer: str | None, example: dict[str, Any]) -> float:
        """The task's own score of an extracted answer (0 for none)."""
        if answer is None:
            return 0.0
        return float(self.dataset.score_answer(answer, self.entry(example)))

    def score_completion(self, example: dict[str, Any], completion: Completion) -> EnvResult:
        score, fmt, reward, correct, well_formed, answer = self._scored(example, completion.text, completion.ended)
        return EnvResult(reward=reward, rewards={"correct": score, "format": fmt},
                         info={"correct": correct, "well_formed": well_formed, "answer": answer})

    def score_columns(self, example: dict[str, Any], texts: list[str], ended: list[bool],
                      finish_reasons: list[str]) -> GroupScores:
        """`score_completion` of a group's completions as columns: each distinct completion text
        extracted and scored once (the task's scorer, a function of the answer and the entry)."""
        score, fmt, reward, correct, well_formed, answer = distinct_scored(
            texts, ended, functools.partial(self._scored, example), 6)
        return GroupScores(reward, {"correct": score, "format": fmt}, None,
                           {"correct": correct, "well_formed": well_formed, "answer": answer})

    def _scored(self, example: dict[str, Any], text: str, ended: bool) -> tuple:
        """(score, format reward, reward, correct, well_formed, answer) of one completion's text."""
        answer = extract_answer(text, self.answer_format)
        score = self.score_answer(answer, example)
        well_formed = answer is not None and answer != ""
        fmt = self.format_reward if well_formed else 0.0
        return score, fmt, score + fmt, score >= 1.0, well_formed, answer
