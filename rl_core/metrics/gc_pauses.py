"""The Python garbage collector in long-lived processes (the controller, `rl-core serve`).

Owns: `freeze_setup_objects()`, called once a process has built its parts, which moves every
object alive then (imported modules, the model's Python objects, the tokenizer) into the
collector's permanent generation (`gc.freeze`, Python >= 3.7), so that later full
collections scan only what the run itself allocates. Measured on the embedded default
(60 RL steps on the CPU): a single full collection paused the controller for 0.33 s; after
the freeze, the run had none and the collector's total time fell from 0.39 s to 0.05 s.
Also `GcClock`: the collector's time and longest pause since the last read, which the
per-step metrics report (`timing/gc_s`, `timing/gc_max_pause_s`, `timing/gc_full_collections`), so a pause that stalls
a refit or a rollout shows up in the step that paid it.

Objects are still freed by reference counting after a freeze; what the freeze gives up is
the collection of reference cycles among the frozen objects, which setup-time objects of
these processes keep for the process lifetime anyway.

`run_thresholds()` raises the collector's allocation thresholds while the controller's pumps
run (restored after): every buffered sample keeps several containers alive (its token
lists, info dict, ...), so at the default gen-0 threshold of 700 allocations the young and
middle collections re-traverse the buffered groups over and over; measured with
`bench/controller_scale.py` at 1,000 groups x 16 samples, the collector took 320 ms of a
590 ms controller step at the defaults and about 100 ms at (50,000, 20, 10), and
the controller's cost per group went from growing with the group count to nearly flat.
Cyclic garbage lives a little longer (until 50,000 net allocations): a few MB at most.
The gen-0 threshold also grows with the run's in-flight groups (`YOUNG_PER_INFLIGHT_GROUP`
net allocations per group of `async_rl.max_inflight_groups`): a group waiting on its backend or
its decode is a chain of suspended coroutines (their frames, cells, result lists), and a young
collection that falls mid-step traverses every such group started since the last one. At 1,000
groups x 16 (2,000 in flight) the net allocations of one step crossed 50,000, and each of those
collections took 20-55 ms on the event loop (85,000-104,000 young objects: cells, lists,
coroutines); with the threshold above a step's growth (100,000 or 200,000) the run had 2-3
collections of 2-3 ms in 9 steps instead of 4-5 of ~20 (docs/controller.md, "Thirteenth round").

Does not own: memory limits or where the metrics go (metrics.logger).
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
