"""User-facing error types of rl_core.

Owns: the exception classes whose message is meant for a person (a recipe that does not
validate, a checkpoint that does not match its manifest, a run that stalled) and the one
format they share: what is wrong (field or file), what was received, what was expected,
and the fix, in one paragraph. Does not own: catching them (the CLI does that and exits
with status 2 and no traceback) or internal invariants (those stay `assert`s).
"""

from __future__ import annotations

from typing import Any


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class UserError(Exception):
    """An error caused by input a person gave us; the CLI prints it without a traceback."""

    exit_code = 2


class RecipeError(UserError, ValueError):
    """A recipe (or workflow config) value that cannot be used.

    Each problem is named by its dotted field path (``grpo.num_generations_per_prompt``),
    the value received, what was expected and how to fix it.
    """

    def __init__(self, problems: list[dict[str, Any]], source: str | None = None):
        self.problems = problems
        self.source = source
        super().__init__(self.render())

    @classmethod
    def single(cls, field: str, value: Any, expected: str, fix: str, source: str | None = None) -> "RecipeError":
        return cls([{"field": field, "value": value, "expected": expected, "fix": fix}], source)

    def render(self) -> str:
        where = f" in {self.source}" if self.source else ""
        n = len(self.problems)
        head = f"Recipe error{where}" + (f" ({n} problems)" if n > 1 else "") + ": "
        parts = []
        for p in self.problems:
            value = "(missing)" if p.get("missing") else _short(p.get("value"))
            parts.append(
                f"field `{p['field']}` got {value}; expected {p['expected']}. Fix: {p['fix']}"
            )
        return head + " ".join(parts)


class CheckpointError(UserError):
    """A checkpoint directory that is incomplete, corrupt or does not match its manifest."""


class DataError(UserError):
    """A data file that is missing or malformed."""


class StallError(RuntimeError):
    """The controller made no progress for longer than the watchdog allows."""


class ArgumentError(UserError):
    """A command-line option whose value cannot be used (`rl-core inspect --step 9999`).

    Rendered like a recipe problem, but naming the option: what was received, what was
    expected and the fix.
    """

    def __init__(self, option: str, value: Any, expected: str, fix: str, command: str | None = None):
        self.option = option
        self.command = command  # the CLI prefixes "rl-core <command>:" itself
        super().__init__(f"option `{option}` got {_short(value)}; expected {expected}. Fix: {fix}")


class EngineOptionsError(UserError, ValueError):
    """A native-engine setting that cannot be used (`rl_core.generation.native.options.EngineOptions`).

    Names the option, what was received, what was expected and the fix; the builders from a
    recipe or from `rl-core serve` flags re-raise it naming the recipe field or the flag.
    """

    def __init__(self, field: str, value: Any, expected: str, fix: str):
        self.field, self.value, self.expected, self.fix = field, value, expected, fix
        super().__init__(f"engine option `{field}` got {_short(value)}; expected {expected}. Fix: {fix}")


class OutputPathError(UserError):
    """An output path rl_core would have to delete or overwrite but did not create itself."""
