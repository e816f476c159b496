"""Metrics sinks: `metrics.jsonl` (one JSON object per record) and the experiment trackers.

Owns: writing scalar metrics with a step and a namespace (`train/...`, `val/...`,
`timing/...`) to metrics.jsonl and fanning the same scalars out to every tracker sink
(trackers.py: TensorBoard, W&B, MLflow), flushing so a killed run keeps what it logged.
Does not own: computing metrics (the pumps do), the trackers' libraries (trackers.py) or
terminal output (progress.py).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def _clean(v: Any):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def tracker_scalars(metrics: dict[str, Any], kind: str) -> dict[str, float]:
    """The finite numbers of one record under their tracker names (`<kind>/<name>` unless the
    name already has a namespace)."""
    return {(k if "/" in k else f"{kind}/{k}"): v for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class MetricsLogger:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True, jsonl: bool = True,
                 filename: str = "metrics.jsonl", sinks: list | None = None):
        """`sinks`: the tracker sinks (`trackers.open_sinks`); None = TensorBoard alone when
        `tensorboard` (under <run_dir>/tensorboard)."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / filename, "a") if jsonl else None
        if sinks is None:
            from rl_core.metrics.trackers import TensorBoardSink

            sinks = [TensorBoardSink(self.run_dir / "tensorboard")] if tensorboard else []
        self._sinks = list(sinks)

    @classmethod
    def for_run(cls, cfg: Any, run_dir: str | Path) -> "MetricsLogger":
        """The logger of a run's process: metrics.jsonl per `logging.jsonl`, the trackers of `logging.trackers`."""
        from rl_core.metrics.trackers import open_sinks

        return cls(run_dir, jsonl=cfg.logging.jsonl, sinks=open_sinks(cfg, run_dir))

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        """Scalars to JSONL and every tracker; lists under the key `_histograms` go to TensorBoard only."""
        metrics = dict(metrics)
        hists = metrics.pop("_histograms", {}) or {}
        record = {"kind": kind, "step": step, "time": time.time()}
        record.update({k: _clean(v) for k, v in metrics.items()})
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        scalars = tracker_scalars(metrics, kind)
        for sink in self._sinks:
            sink.write(step, scalars, hists)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()


def read_jsonl(path: str | Path, kind: str | None = None) -> list[dict]:
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if kind is None or rec.get("kind") == kind:
            out.append(rec)
    return out
