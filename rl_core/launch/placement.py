"""Placement and start-up: where generation runs, and setting it up while the trainer builds.

Owns: the start-up overlap: the generation side (load weights into the native engine, start
`rl-core serve` processes, or vLLM's engine or server) runs in a worker thread while the
calling thread builds the trainer, so set-up takes about as long as the slower of the two;
each part's start and end are recorded (`SetupRecord`: a printed `[setup]` line,
`timing/setup/*` metrics, `setup_*` timeline spans). The backend is built through the
registry `rl_core.generation.GENERATION_BACKENDS` (`make_generation_backend`, re-exported
here): native/colocated, vllm/colocated, vllm/separate, http/separate.

Does not own: the backends themselves (rl_core.generation), the support table's errors
(rl_core.config.placement_rules), the trainer's construction (the caller passes a factory),
or the controller's life cycle. Read more: docs/generation.md, "Start-up overlap".
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rl_core.generation import make_generation_backend  # the registry's builder, by generation.backend


@dataclass
class SetupRecord:
    """Start/end (time.monotonic) of each set-up part, and of the whole set-up."""

    label: str = ""
    parts: dict[str, tuple[float, float]] = field(default_factory=dict)
    start: float = 0.0
    end: float = 0.0

    def seconds(self, name: str) -> float:
        a, b = self.parts[name]
        return b - a

    @property
    def total_s(self) -> float:
        return self.end - self.start

    @property
    def sum_s(self) -> float:
        return sum(b - a for a, b in self.parts.values())

    def overlap_s(self) -> float:
        """Seconds during which the generation and trainer set-ups both ran."""
        if {"generation", "trainer"} - set(self.parts):
            return 0.0
        (g0, g1), (t0, t1) = self.parts["generation"], self.parts["trainer"]
        return max(0.0, min(g1, t1) - max(g0, t0))

    def metrics(self) -> dict[str, float]:
        out = {f"timing/setup/{name}_s": self.seconds(name) for name in self.parts}
        out["timing/setup/total_s"] = self.total_s
        out["timing/setup/sum_s"] = self.sum_s
        out["timing/setup/overlap_s"] = self.overlap_s()
        return out

    def line(self) -> str:
        parts = ", ".join(f"{name} {self.seconds(name):.1f}s" for name in self.parts)
        return (f"[setup] {parts}{f' ({self.label})' if self.label else ''}; total {self.total_s:.1f}s "
                f"(sum of parts {self.sum_s:.1f}s, overlapped {self.overlap_s():.1f}s)")

    def report(self, logger: Any, timeline: Any, step: int) -> None:
        """Log `timing/setup/*` (kind "setup") and add `setup_<part>` spans to the timeline."""
        logger.log(step, self.metrics(), kind="setup")
        for name, (a, b) in self.parts.items():  # on the timeline's clock (negative: before the run began)
            timeline.add(f"setup_{name}", step, a, b, step)


def close_unstarted(backend: Any) -> None:
    """Release a backend that was set up but never started (a failed start-up)."""
    close = getattr(backend, "close_sync", None)
    if close is not None:
        close()


def build_overlapped(cfg: Any, policy_dir: str | Path, *, tokenizer: Any, device: str, weight_version: int,
                     make_trainer: Callable[[], Any], echo: Callable[[str], None] | None = print
                     ) -> tuple[Any, Any, SetupRecord]:
    """(backend, trainer, record): the generation backend is set up in a worker thread while
    `make_trainer()` runs in this one. If either fails, the other is released and the
    first error is raised."""
    record = SetupRecord(label=f"{cfg.generation.backend}/{cfg.generation.placement}")
    box: dict[str, Any] = {}
    record.start = time.monotonic()

    def generation() -> None:
        t0 = time.monotonic()
        try:
            box["backend"] = make_generation_backend(cfg, policy_dir, tokenizer=tokenizer, device=device,
                                                     weight_version=weight_version)
        except BaseException as exc:  # re-raised in the calling thread
            box["error"] = exc
        finally:
            record.parts["generation"] = (t0, time.monotonic())

    thread = threading.Thread(target=generation, name="setup-generation", daemon=True)
    thread.start()
    t0 = time.monotonic()
    trainer = None
    try:
        trainer = make_trainer()
    finally:
        record.parts["trainer"] = (t0, time.monotonic())
        thread.join()
        record.end = time.monotonic()
        if trainer is None and "backend" in box:
            close_unstarted(box["backend"])
    if "error" in box:
        raise box["error"]
    if echo is not None:
        echo(record.line())
    return box["backend"], trainer, record
