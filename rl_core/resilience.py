"""Failure handling of the pumps: classification, retry budgets with backoff, deadlines.

Owns: deciding whether an exception is an *infrastructure* failure (worth retrying
elsewhere or later: timeouts, dead or unreachable backends, transport errors, HTTP 5xx /
408 / 429, out-of-memory) or a *data* failure (deterministic: a bad example, an
environment bug, HTTP 4xx), the per-group attempt counters with their separate budgets,
the exponential backoff, the error raised when a budget is exhausted, and ending sibling
tasks when one fails (`gather_or_cancel`, `cancel_and_wait`).

Does not own: what is retried (the rollout pump decides), drop budgets (rollout pump),
or train-step retries (train pump).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field


class FailureKind(str, enum.Enum):
    INFRA = "infra"
    DATA = "data"


INFRA_TYPES: tuple[type[BaseException], ...] = (TimeoutError, asyncio.TimeoutError, ConnectionError, EOFError,
                                                BrokenPipeError)


def classify(exc: BaseException) -> FailureKind:
    """INFRA for failures of the machinery, DATA for failures of the input (see module docstring)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, INFRA_TYPES):
            return FailureKind.INFRA
        name = type(exc).__name__
        if name in ("GenerationError", "BackendUnavailable", "TransportError", "ConnectError", "ReadTimeout",
                    "RemoteProtocolError", "OutOfMemoryError"):
            return FailureKind.INFRA
        status = getattr(getattr(exc, "response", None), "status_code", None) or getattr(exc, "status_code", None)
        if isinstance(status, int):
            return FailureKind.INFRA if status >= 500 or status in (408, 429) else FailureKind.DATA
        if isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower():
            return FailureKind.INFRA
        exc = exc.__cause__ or exc.__context__
    return FailureKind.DATA


@dataclass
class Attempts:
    """Attempt counters of one group, and the budgets they are checked against."""

    max_infra: int
    max_data: int
    infra: int = 0
    data: int = 0
    errors: list[str] = field(default_factory=list)

    def record(self, exc: BaseException) -> FailureKind:
        kind = classify(exc)
        if kind is FailureKind.INFRA:
            self.infra += 1
        else:
            self.data += 1
        self.errors.append(f"{kind.value}: {type(exc).__name__}: {exc}")
        return kind

    @property
    def exhausted(self) -> bool:
        return self.infra >= self.max_infra or self.data >= self.max_data

    def describe(self) -> str:
        return (f"{self.infra}/{self.max_infra} infra and {self.data}/{self.max_data} data attempts failed "
                f"(last: {self.errors[-1] if self.errors else 'none'})")


def backoff_s(attempt: int, base_s: float, max_s: float) -> float:
    """min(base * 2^(attempt-1), max) for the attempt-th infra failure (1-based)."""
    return min(base_s * (2 ** max(0, attempt - 1)), max_s)


class GroupDropped(RuntimeError):
    """A group exhausted its attempts and the drop budget is spent: the run stops."""


async def with_deadline(coro, timeout_s: float | None, what: str):
    """Await `coro` with an optional deadline; a miss raises TimeoutError naming `what` (INFRA)."""
    if timeout_s is None:
        return await coro
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{what} missed its {timeout_s:g}s deadline") from None


async def cancel_and_wait(tasks) -> None:
    """Cancel `tasks` and wait until every one has ended, so that their cancellation paths (an
    abort in the engine, a server's abort route) have run; their outcomes are dropped."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def gather_or_cancel(tasks) -> list:
    """The results of `tasks`, in order. When one fails, or the caller is cancelled, the others
    are cancelled and waited for (`cancel_and_wait`) before the exception propagates."""
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await cancel_and_wait(tasks)
        raise
