"""Metrics sinks: `metrics.jsonl` (one JSON object per record) and TensorBoard event files.

Owns: writing scalar metrics with a step and a namespace (`train/...`, `val/...`,
`timing/...`), flushing so a killed run keeps what it logged. Does not own: computing
metrics (the pumps do) or terminal output (progress.py).
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


class MetricsLogger:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True, jsonl: bool = True,
                 filename: str = "metrics.jsonl"):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / filename, "a") if jsonl else None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        """Scalars to JSONL and TensorBoard; lists under the key `_histograms` go to TensorBoard only."""
        metrics = dict(metrics)
        hists = metrics.pop("_histograms", {}) or {}
        if self._tb is not None:
            for name, values in hists.items():
                if values:
                    import numpy as np

                    self._tb.add_histogram(name, np.asarray(values, dtype=np.float64), step)
        record = {"kind": kind, "step": step, "time": time.time()}
        record.update({k: _clean(v) for k, v in metrics.items()})
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k if "/" in k else f"{kind}/{k}", v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


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
