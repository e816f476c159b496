"""The Python garbage collector in long-lived processes (the controller, `rl-core serve`).

Owns: `freeze_setup_objects()`, called once a process has built its parts: every object alive
then (modules, the model's Python objects, the tokenizer) moves into the permanent generation
(`gc.freeze`), so later full collections scan only what the run allocates (cycles among the
frozen objects are not collected: setup objects live as long as the process anyway);
`GcClock`, the collector's time and longest pause since the last read (`timing/gc_s`,
`timing/gc_max_pause_s`, `timing/gc_full_collections` per step); and `run_thresholds()`,
raised allocation thresholds while the pumps run (restored after): buffered and in-flight
groups hold many containers, and at the default thresholds young collections re-traverse
them over and over; gen 0 is at least `YOUNG_PER_INFLIGHT_GROUP` per in-flight group.

Does not own: memory limits or where the metrics go (metrics.logger). Read more:
docs/controller.md, "Metrics in the train-step log" and "What we learned".
"""

from __future__ import annotations

import gc
import threading
import time


def freeze_setup_objects() -> int:
    """Collect once, then freeze every surviving object; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


RUN_THRESHOLDS = (50_000, 20, 10)  # gen-0 allocations, gen-0 runs per gen-1, gen-1 runs per gen-2
YOUNG_PER_INFLIGHT_GROUP = 100  # gen-0 allocations allowed per in-flight group (above RUN_THRESHOLDS[0])


def run_thresholds(inflight_groups: int = 0) -> tuple[int, int, int]:
    """Raise the collection thresholds for the pumps (gen 0: at least `YOUNG_PER_INFLIGHT_GROUP`
    per in-flight group, `inflight_groups`); returns the previous ones for `gc.set_threshold`."""
    if inflight_groups < 0:
        raise ValueError(f"inflight_groups must be >= 0, got {inflight_groups}")
    old = gc.get_threshold()
    want = (max(RUN_THRESHOLDS[0], YOUNG_PER_INFLIGHT_GROUP * inflight_groups),) + RUN_THRESHOLDS[1:]
    gc.set_threshold(*(max(a, b) for a, b in zip(want, old)))
    return old


def unfreeze() -> None:
    """Make the frozen objects collectable again (a process that runs several controllers in
    turn, a test session say, unfreezes between them so their cycles are not kept)."""
    gc.unfreeze()


class GcClock:
    """Time spent in the collector, read and reset by `take()`. Install with `start()`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._began: float | None = None  # the running collection's start (one at a time: the GIL)
        self._total = 0.0
        self._max = 0.0
        self._full = 0
        self._installed = False

    def start(self) -> "GcClock":
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def stop(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def _callback(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._began = now
            return
        if self._began is None:  # installed mid-collection
            return
        pause, self._began = now - self._began, None
        with self._lock:
            self._total += pause
            self._max = max(self._max, pause)
            self._full += info.get("generation") == 2

    def take(self) -> dict[str, float]:
        """{"gc_s", "gc_max_pause_s", "gc_full_collections"} since the last take; resets them."""
        with self._lock:
            out = {"gc_s": self._total, "gc_max_pause_s": self._max, "gc_full_collections": float(self._full)}
            self._total, self._max, self._full = 0.0, 0.0, 0
        return out
