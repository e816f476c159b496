"""Failure handling of the pumps: classification, retry budgets with backoff, deadlines.

Owns: deciding whether an exception is an *infrastructure* failure (worth retrying
elsewhere or later: timeouts, dead or unreachable backends, transport errors, HTTP 5xx /
408 / 429, out-of-memory) or a *data* failure (deterministic: a bad example, an
environment bug, HTTP 4xx), the per-group attempt counters with their separate budgets,
a time budget of infra retries, the exponential backoff, the retry loop (`retrying`), the
error raised when a budget is exhausted (`group_failed`: one paragraph naming the example
and where the user's code raised), and ending sibling tasks when one fails
(`gather_or_cancel`, `cancel_and_wait`).

Does not own: what is retried (the rollout pump and validation decide), drop budgets
(rollout pump, validation), or train-step retries (train pump).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass

from rl_core.errors import UserError, short_repr, user_frame


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
    """Attempt counters of one group, and the budgets they are checked against: at most
    `max_data` data failures; infra failures are retried until `max_infra` attempts (None: no
    count limit) or until `infra_budget_s` seconds have passed since the first (None: no time
    limit), with exponential backoff in between (`backoff`)."""

    max_infra: int | None
    max_data: int
    infra_budget_s: float | None = None
    infra: int = 0
    data: int = 0
    first_infra_at: float | None = None  # time.monotonic() of the first infra failure
    last_kind: FailureKind | None = None
    last_error: str = "none"  # "Type: message" of the last failure
    last_frame: str | None = None  # where the user's code raised the last failure (errors.user_frame)
    last_stuck: str | None = None  # where the user's code was stuck when the last failure's deadline passed

    @classmethod
    def of(cls, policy) -> "Attempts":
        """Fresh counters under a recipe's `async_rl.failure` section (RolloutFailureConfig)."""
        return cls(policy.max_infra_attempts_per_group, policy.max_data_attempts_per_group,
                   policy.infra_retry_budget_s)

    def record(self, exc: BaseException) -> FailureKind:
        kind = self.last_kind = classify(exc)
        if kind is FailureKind.INFRA:
            self.infra += 1
            if self.first_infra_at is None:
                self.first_infra_at = time.monotonic()
        else:
            self.data += 1
        self.last_frame = user_frame(exc) if kind is FailureKind.DATA else None
        self.last_stuck = getattr(exc, "stuck_at", None) if kind is FailureKind.INFRA else None
        self.last_error = f"{type(exc).__name__}: {exc}"
        return kind

    def infra_elapsed_s(self) -> float:
        """Seconds since the first infra failure (0 before one)."""
        return 0.0 if self.first_infra_at is None else time.monotonic() - self.first_infra_at

    @property
    def exhausted(self) -> bool:
        if self.data >= self.max_data:
            return True
        if self.max_infra is not None and self.infra >= self.max_infra:
            return True
        return self.infra_budget_s is not None and self.infra > 0 and self.infra_elapsed_s() >= self.infra_budget_s

    def backoff(self, base_s: float, max_s: float) -> float:
        """The wait before the next attempt after an infra failure: `backoff_s`, but never past
        the time budget (the last attempt then falls at its end)."""
        wait = backoff_s(self.infra, base_s, max_s)
        if self.infra_budget_s is not None:
            wait = min(wait, max(0.0, self.infra_budget_s - self.infra_elapsed_s()))
        return wait

    def counts(self) -> str:
        """The failed attempts against their budgets, naming the recipe fields."""
        parts = []
        if self.data:
            parts.append(f"{self.data}/{self.max_data} data attempts (async_rl.failure.max_data_attempts_per_group)")
        if self.infra:
            cap = "" if self.max_infra is None else f"/{self.max_infra}"
            budget = "" if self.infra_budget_s is None else f", budget {self.infra_budget_s:g} s"
            parts.append(f"{self.infra}{cap} infra attempts over {self.infra_elapsed_s():.1f} s "
                         f"(async_rl.failure.max_infra_attempts_per_group / infra_retry_budget_s{budget})")
        return " and ".join(parts) or "no attempt"

    def describe(self) -> str:
        where = f", at {self.last_frame}" if self.last_frame else ""
        return f"{self.counts()} failed (last: {self.last_error}{where})"


def backoff_s(attempt: int, base_s: float, max_s: float) -> float:
    """min(base * 2^(attempt-1), max) for the attempt-th infra failure (1-based)."""
    return min(base_s * (2 ** max(0, attempt - 1)), max_s)


class GroupDropped(UserError, RuntimeError):
    """A group exhausted its attempts and the drop budget is spent: the run stops. One
    paragraph (the group, its example, the last failure and where the user's code raised it,
    the fix); the CLI shows it without a traceback and writes the traceback to the run's log."""


def group_failed(what: str, example, attempts: Attempts, budget: str) -> GroupDropped:
    """The error that stops a run when `what` (a prompt group, named) exhausted `attempts`, in
    one paragraph: the last failure and where the user's code raised it, the group and its
    example (short), the attempts, and the fix; `budget` names the drop budget that is spent."""
    at = f" (at {attempts.last_frame})" if attempts.last_frame else ""
    if attempts.last_kind is FailureKind.INFRA and attempts.last_stuck:
        fix = (f"make your code at {attempts.last_stuck} finish within its deadline (it was still there when the "
               f"deadline passed), or raise the deadline; or let such groups be dropped ({budget})")
    elif attempts.last_kind is FailureKind.INFRA:
        fix = (f"bring the failing service or backend back (the group retried for {attempts.infra_elapsed_s():.0f} s); "
               f"raise async_rl.failure.infra_retry_budget_s to wait longer, or let such groups be dropped ({budget})")
    elif attempts.last_frame:
        fix = f"correct your code at {attempts.last_frame}, or let such groups be dropped ({budget})"
    else:
        fix = f"repair the cause named first, or raise the retry or drop budgets ({budget})"
    return GroupDropped(f"{attempts.last_error}{at}. The run stops: {what} {short_repr(example, 100)} failed "
                        f"{attempts.counts()}. Fix: {fix}.")


def retry_notice(kind: FailureKind, exc: BaseException, where: str, policy) -> str:
    """The console line of a retried failure of `where` ("training", "validation start") under
    `policy` (`async_rl.failure`)."""
    how = (f"backing off, for up to async_rl.failure.infra_retry_budget_s={policy.infra_retry_budget_s:g} s per group"
           if kind is FailureKind.INFRA and policy.infra_retry_budget_s is not None else "retrying")
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return f"[retry] {where}: {kind.value} failure, {how}: {text[:240]}"


async def retrying(run, attempts: Attempts, base_s: float, max_s: float, on_retry=None):
    """`await run()` until it returns: a failure is recorded in `attempts` and, while they are
    not exhausted, retried (an infra failure after `attempts.backoff`, a data failure at once),
    `on_retry(kind, exc)` told first; exhausted, the last failure propagates. Cancellation
    propagates at once."""
    while True:
        try:
            return await run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified, then retried or re-raised
            kind = attempts.record(exc)
            if attempts.exhausted:
                raise
            if on_retry is not None:
                on_retry(kind, exc)
            if kind is FailureKind.INFRA:
                await asyncio.sleep(attempts.backoff(base_s, max_s))


async def with_deadline(coro, timeout_s: float | None, what: str):
    """Await `coro` with an optional deadline; a miss raises TimeoutError naming `what` (INFRA)."""
    if timeout_s is None:
        return await coro
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except asyncio.TimeoutError as exc:  # a user loop's cancelled coroutine tells where it awaited (usercode)
        raise deadline_missed(what, timeout_s, getattr(exc.__cause__, "stuck_at", None)) from None


def deadline_missed(what: str, timeout_s: float, stuck_at: str | None = None) -> TimeoutError:
    """The error of `what` missing its deadline (INFRA); `stuck_at`: where the user's code was
    still running or waiting when it passed (`usercode.stuck_at`), named in the message and kept
    on the error (`Attempts.last_stuck`, the fix of `group_failed`)."""
    exc = TimeoutError(f"{what} missed its {timeout_s:g}s deadline" + (f" (it is stuck at {stuck_at})" if stuck_at
                                                                        else ""))
    exc.stuck_at = stuck_at
    return exc


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
