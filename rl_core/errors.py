"""User-facing error types of rl_core.

Owns: the exception classes whose message is meant for a person (a recipe that does not
validate, a checkpoint that does not match its manifest, a run that stalled) and the one
format they share: what is wrong (field or file), what was received, what was expected,
and the fix, in one paragraph; where a user's code raised (`user_frame`). Does not own:
catching them (the CLI does that and exits with status 2 and no traceback) or internal
invariants (those stay `assert`s).
"""

from __future__ import annotations

import functools
import os
import sysconfig
import traceback
from typing import Any


def short_repr(value: Any, limit: int = 120) -> str:
    """repr(value), cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@functools.lru_cache(maxsize=1)
def _installed_dirs() -> tuple[str, ...]:
    """rl_core's own directory and the Python installation's (standard library, site-packages)."""
    paths = sysconfig.get_paths()
    dirs = {os.path.dirname(os.path.realpath(__file__))}
    dirs.update(os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths)
    return tuple(d.rstrip(os.sep) + os.sep for d in dirs)


def is_user_file(filename: str) -> bool:
    """Whether `filename` is the user's code: a real file outside rl_core and the Python installation."""
    return not filename.startswith("<") and not os.path.realpath(filename).startswith(_installed_dirs())


def user_frame(exc: BaseException) -> str | None:
    """Where the user's code (an agent, a reward function, an environment) raised `exc` or the
    exception it was raised from: `file:line in function` of the last traceback frame outside
    rl_core and outside the Python installation, in the innermost exception of the cause
    chain that has one; None when no frame is the user's (the full traceback goes to a log)."""
    chain: list[BaseException] = []
    while exc is not None and all(exc is not e for e in chain):
        chain.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    skip = _installed_dirs()
    for e in reversed(chain):
        for frame in reversed(traceback.extract_tb(e.__traceback__)):
            name = frame.filename
            if not name.startswith("<") and not os.path.realpath(name).startswith(skip):
                return f"{name}:{frame.lineno} in {frame.name}"
    return None


class UserError(Exception):
    """An error caused by input a person gave us; the CLI prints it without a traceback (a
    failure of the run, e.g. a user's agent that raised, keeps its traceback in the log file
    the command names: `log_path`)."""

    exit_code = 2
    log_path: str | None = None


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
            value = "(missing)" if p.get("missing") else short_repr(p.get("value"))
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
        super().__init__(f"option `{option}` got {short_repr(value)}; expected {expected}. Fix: {fix}")


class EngineOptionsError(UserError, ValueError):
    """A native-engine setting that cannot be used (`rl_core.generation.native.options.EngineOptions`).

    Names the option, what was received, what was expected and the fix; the builders from a
    recipe or from `rl-core serve` flags re-raise it naming the recipe field or the flag.
    """

    def __init__(self, field: str, value: Any, expected: str, fix: str):
        self.field, self.value, self.expected, self.fix = field, value, expected, fix
        super().__init__(f"engine option `{field}` got {short_repr(value)}; expected {expected}. Fix: {fix}")


class OutputPathError(UserError):
    """An output path rl_core would have to delete or overwrite but did not create itself."""
