"""`env.type: reasoning_gym`: a reasoning-gym task scored by the task's own scorer.

Owns the answer format and the scoring:
- the observation is the example's question (`prompt`), followed by a blank line and
  `env.instruction` (default: "Give your final answer between <answer> and </answer>."),
  as raw text or through the chat template (`env.use_chat_template`);
- the answer is read from the completion (end token removed): with `answer_format:
  answer_tag` the text between the *last* `<answer>` and the `</answer>` after it, stripped
  (none found: no answer); with `last_line` the last non-empty line, stripped;
- the score is `dataset.score_answer(answer, entry)` of the reasoning-gym dataset built
  from `env.task` and `env.config` (the same settings the data was generated with), where
  `entry` = {question: prompt, answer, metadata} of the example; reasoning-gym scorers are
  in [0, 1] and some give partial credit;
- reward = score + format_reward * well_formed (an answer was found in the format);
  components `correct` (the score) and `format`; `info['correct']` = score >= 1.

A group generated in one call (and no `env_timeout_s`) is scored in one call (`score_columns`,
BaseEnv's `score_group`): each distinct completion text extracted and scored once, which
takes the task's scorer to be a function of the answer and the entry (reasoning-gym's are).

The data comes from `rl-core make-data reasoning_gym` (rl_core.data.reasoning_gym).
Does not own: templating and end tokens (base.py).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from rl_core.columns import GroupScores
from rl_core.envs import register_env
from rl_core.envs.base import BaseEnv, Completion, distinct_scored
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
class ReasoningGymEnv(BaseEnv):
    name = "reasoning_gym"
    reward_names = ("correct", "format")

    def __init__(self, config: Any, tokenizer: Any):
        from rl_core.data.reasoning_gym import task_dataset

        self.use_chat_template = bool(config.use_chat_template)
        self.system_prompt = config.system_prompt
        super().__init__(config, tokenizer)
        self.task = config.task
        self.dataset = task_dataset(config.task, dict(config.config))
        self.answer_format = config.answer_format
        self.instruction = config.instruction
        self.format_reward = float(config.format_reward)

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
