"""The math environment: a final answer extracted from the completion, checked with math-verify.

Owns the scoring rule of `env.type: math` (config: `MathEnvConfig`): the prompt (plus
`env.instruction`) through the chat template with `env.system_prompt`, or raw text; the
answer extracted by `env.answer_format` (`boxed`, `hash`, `last_number`, `number_only`); the
gold answer reduced to its final answer (GSM8K `####`, `\\boxed{}`); components `format` (ended
on an end token, an answer found) and `correct` (`format` and equal as a string, else by
`math_verify.verify`), `reward = correct_reward * correct + format_reward * format`; a
truncated sample scores 0. math-verify's SIGALRM timeouts are off (scoring runs in a thread
pool): the answer is capped at `MAX_ANSWER_CHARS`, the deadline is `env_timeout_s`. A group
generated in one call is scored in one call, each distinct completion text checked once.

Does not own: templating and end tokens (`base.py`) or the data (`rl_core.data.arithmetic`
makes the SmolLM2 recipe's). Read more: docs/environments.md, "math".
"""

from __future__ import annotations

import functools
import logging
import re
from functools import lru_cache
from typing import Any

from rl_core.columns import GroupScores
from rl_core.envs import register_env
from rl_core.envs.base import Completion, FinalAnswerEnv, distinct_scored
from rl_core.types import EnvResult

ANSWER_FORMATS = ("boxed", "hash", "last_number", "number_only")
MAX_ANSWER_CHARS = 256
"""Longest extracted answer handed to math-verify (a longer one counts as wrong: parsing
arbitrary long LaTeX with sympy can take unbounded time)."""

_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_NUMBER_ONLY_RE = re.compile(rf"\s*({_NUMBER})\s*")
_BOX_OPENERS = ("\\boxed{", "\\fbox{")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` with balanced braces, else None."""
    start = max(text.rfind(op) + len(op) if text.rfind(op) >= 0 else -1 for op in _BOX_OPENERS)
    if start < 0:
        return None
    depth = 1
    for i in range(start, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                inner = text[start:i].strip()
                return inner or None
    return None  # unbalanced: the box never closes


def extract_hash(text: str) -> str | None:
    """The rest of the line after the last `####`, stripped, else None."""
    pos = text.rfind("####")
    if pos < 0:
        return None
    answer = text[pos + 4:].split("\n", 1)[0].strip()
    return answer or None


def extract_last_number(text: str) -> str | None:
    """The last number in the text (thousands commas kept, see `normalize`), else None."""
    found = _NUMBER_RE.findall(text)
    return found[-1] if found else None


def extract_number_only(text: str) -> str | None:
    """The reply itself when it is exactly one number (surrounding whitespace allowed), else None."""
    m = _NUMBER_ONLY_RE.fullmatch(text)
    return m.group(1) if m else None


EXTRACTORS = {"boxed": extract_boxed, "hash": extract_hash, "last_number": extract_last_number,
              "number_only": extract_number_only}


def gold_answer(answer: str) -> str:
    """The final answer of a dataset `answer`: after its last `####`, else inside its last
    `\\boxed{}`, else the whole string (stripped)."""
    return extract_hash(answer) or extract_boxed(answer) or answer.strip()


def normalize(answer: str) -> str:
    """The string compared before math-verify runs: no surrounding whitespace or `$`, no
    thousands commas in a number, no leading `+`."""
    s = answer.strip().strip("$").strip()
    if _NUMBER_ONLY_RE.fullmatch(s):
        s = s.replace(",", "").lstrip("+")
    return s


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's one-time notice that its timeouts are off: they are off on purpose
    here (see the module docstring), and the notice would read as a problem in every run log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


def _quiet_timeout_notice() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _NoTimeoutNotice) for f in log.filters):
            log.addFilter(_NoTimeoutNotice())


@lru_cache(maxsize=4096)
def _parsed_gold(gold: str):
    from math_verify import parse

    return parse(gold, parsing_timeout=None)


def answers_match(gold: str, answer: str) -> bool:
    """True when `answer` equals `gold` (normalized strings) or math-verify finds them equivalent."""
    g, a = normalize(gold), normalize(answer)
    if g == a:
        return True
    if len(a) > MAX_ANSWER_CHARS:
        return False
    from math_verify import parse, verify

    parsed_gold = _parsed_gold(g)
    parsed = parse(a, parsing_timeout=None)
    if not parsed_gold or not parsed:
        return False
    return bool(verify(parsed_gold, parsed, timeout_seconds=None))


@register_env("math")
class MathEnv(FinalAnswerEnv):
    """Final-answer math problems (config: `MathEnvConfig`)."""

    name = "math"

    def __init__(self, config: Any, tokenizer: Any):
        super().__init__(config, tokenizer)
        import math_verify  # noqa: F401  (fail here, not at the first score, when the package is missing)

        _quiet_timeout_notice()

        if config.answer_format not in EXTRACTORS:
            raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {config.answer_format!r}")
        self.extract = EXTRACTORS[config.answer_format]
        self.correct_reward = float(config.correct_reward)

    def prompt_text(self, example: dict[str, Any]) -> str:
        prompt = str(example["prompt"])
        return f"{prompt} {self.instruction}" if self.instruction else prompt

    def reference_text(self, example: dict[str, Any]) -> str:
        """The gold answer written in the required format (what the supervised warm-up trains on)."""
        gold = gold_answer(str(example["answer"]))
        if self.answer_format == "boxed":
            return f"\\boxed{{{gold}}}"
        if self.answer_format == "hash":
            return f"#### {gold}"
        return gold

    def score_completion(self, example: dict[str, Any], completion: Completion) -> EnvResult:
        correct, well_formed, answer, reward = self._scored(gold_answer(str(example["answer"])), completion.text,
                                                            completion.ended)
        return EnvResult(
            reward=reward,
            rewards={"correct": float(correct), "format": float(well_formed)},
            info={"correct": correct, "well_formed": well_formed, "answer": answer},
        )

    def score_columns(self, example: dict[str, Any], texts: list[str], ended: list[bool],
                      finish_reasons: list[str]) -> GroupScores:
        """`score_completion` of a group's completions as columns: the gold answer reduced once
        per group, each distinct (text, ended) extracted and checked once (math-verify's parse
        and verify, the costly part, once per distinct answer)."""
        gold = gold_answer(str(example["answer"]))
        correct, well_formed, answers, rewards = distinct_scored(texts, ended, functools.partial(self._scored, gold),
                                                                 4)
        return GroupScores(rewards, {"correct": list(map(float, correct)), "format": list(map(float, well_formed))},
                           None, {"correct": correct, "well_formed": well_formed, "answer": answers})

    def _scored(self, gold: str, text: str, ended: bool) -> tuple[bool, bool, str | None, float]:
        """(correct, well_formed, the extracted answer, reward) of one completion's text."""
        answer = self.extract(text) if ended else None
        well_formed = answer is not None
        correct = well_formed and answers_match(gold, answer)
        return correct, well_formed, answer, self.correct_reward * float(correct) + self.format_reward * float(well_formed)
