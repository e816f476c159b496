"""Coordination primitives of the single controller.

Owns: the one shared `asyncio.Condition` every pump waits on (buffer changes, version
changes and gate changes all notify it), the trainer-side weight version clock, and the
timeline of generation and training spans (for overlap metrics and tests).

Does not own: any policy (samplers decide, pumps act).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable


async def wait_until(cond: asyncio.Condition, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
    """Wait until predicate() holds; re-evaluated at every notify. False on timeout."""
    async with cond:
        if predicate():
            return True
        try:
            await asyncio.wait_for(cond.wait_for(predicate), timeout)
            return True
        except asyncio.TimeoutError:
            return False


async def notify(cond: asyncio.Condition) -> None:
    async with cond:
        cond.notify_all()


class VersionClock:
    """The weight version the trainer has published (after refit)."""

    def __init__(self, cond: asyncio.Condition, version: int = 0):
        self.cond = cond
        self.version = version

    async def publish(self, version: int) -> None:
        self.version = version
        await notify(self.cond)


@dataclass
class Span:
    kind: str  # "generate" | "train" | "refit" | "validate"
    step: int  # target step (generate), RL step (train/refit), version (validate)
    start: float
    end: float
    version: int = -1  # weight version at the start (generate: dispatch version)


class Timeline:
    def __init__(self):
        self.spans: list[Span] = []
        self.t0 = time.monotonic()

    def add(self, kind: str, step: int, start: float, end: float, version: int = -1) -> None:
        self.spans.append(Span(kind, step, start - self.t0, end - self.t0, version))

    def of(self, kind: str) -> list[Span]:
        return [s for s in self.spans if s.kind == kind]

    def write(self, path: str | Path) -> None:
        with open(path, "w") as fh:
            for s in self.spans:
                fh.write(json.dumps(asdict(s)) + "\n")

    @staticmethod
    def read(path: str | Path) -> list[Span]:
        return [Span(**json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]


def overlap_seconds(a: list[Span], b: list[Span]) -> float:
    """Total time during which some span of `a` and some span of `b` both run."""
    def merge(spans):
        out: list[list[float]] = []
        for s in sorted(spans, key=lambda s: s.start):
            if out and s.start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], s.end)
            else:
                out.append([s.start, s.end])
        return out

    total, ma, mb = 0.0, merge(a), merge(b)
    i = j = 0
    while i < len(ma) and j < len(mb):
        lo, hi = max(ma[i][0], mb[j][0]), min(ma[i][1], mb[j][1])
        if hi > lo:
            total += hi - lo
        if ma[i][1] < mb[j][1]:
            i += 1
        else:
            j += 1
    return total
