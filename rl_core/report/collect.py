"""Reading a workflow run's result files into one structure for the report.

Owns: finding the epochs of `results/<run>/` (`epoch_<k>/` directories, numeric order),
reading each epoch's `metrics.jsonl` (kind `train` per RL step, kind `val` for in-training
validations), `summary.json` and `validation.json`, the run's `init_validation.json` and
`evaluation.json`, and the per-step and per-epoch series the plots draw (the reward's named
components among them). Missing files or metrics become empty series / NaN (a report of a
partial run still renders).

Does not own: drawing (render.py) or computing any metric (the stages did).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_core.metrics.logger import read_jsonl

STEP_SERIES = {
    "reward": "train/reward_mean",
    "accuracy": "train/accuracy",
    "staleness_mean": "staleness/mean",
    "staleness_max": "staleness/max",
    "generated_tokens_per_s": "throughput/generated_tokens_per_s",
    "trained_tokens_per_s": "throughput/trained_tokens_per_s",
    "step_s": "timing/step_s",
}


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def pass_at(record: dict | None) -> tuple[int | None, float]:
    """(k, pass@k) of a validation/evaluation record."""
    if not record:
        return None, math.nan
    for key, value in record.items():
        m = re.fullmatch(r"pass@(\d+)", key)
        if m:
            return int(m.group(1)), _num(value)
    return None, math.nan


@dataclass
class EpochData:
    epoch: int
    train: list[dict] = field(default_factory=list)
    val_inline: list[dict] = field(default_factory=list)
    summary: dict | None = None
    validation: dict | None = None

    def series(self, name: str) -> list[float]:
        """Per RL step: a `STEP_SERIES` name, or a metric's own key (e.g. `reward/<component>`)."""
        key = STEP_SERIES.get(name, name)
        return [_num(r.get(key)) for r in self.train]

    @property
    def steps(self) -> list[int]:
        return [int(r["step"]) for r in self.train]


@dataclass
class RunData:
    run: str
    run_dir: Path
    epochs: list[EpochData]
    init_validation: dict | None
    evaluation: dict | None

    def steps(self) -> list[int]:
        return [s for e in self.epochs for s in e.steps]

    def series(self, name: str) -> list[float]:
        return [v for e in self.epochs for v in e.series(name)]

    def reward_components(self) -> list[str]:
        """The metric keys of the named reward components (`reward/<name>`) any RL step logged, sorted."""
        return sorted({k for e in self.epochs for r in e.train for k in r if k.startswith("reward/")})

    def epoch_boundaries(self) -> list[int]:
        """The last RL step of every epoch but the last (where the plots draw a line)."""
        return [e.steps[-1] for e in self.epochs[:-1] if e.steps]

    def per_epoch(self) -> list[dict[str, Any]]:
        rows = []
        for e in self.epochs:
            s = e.summary or {}
            # the epoch's own tokens (a resumed process restores the run's running total)
            gen_tokens = _num(s.get("generated_tokens_this_process", s.get("generated_tokens")))
            wall = _num(s.get("pumps_s", s.get("wall_s")))
            k, pk = pass_at(e.validation)
            rows.append({
                "epoch": e.epoch, "num_steps": len(e.train),
                "last_step": e.steps[-1] if e.steps else None,
                "reward": _mean(e.series("reward")), "accuracy": _mean(e.series("accuracy")),
                "staleness_mean": _mean(e.series("staleness_mean")),
                "staleness_max": max((x for x in e.series("staleness_max") if not math.isnan(x)), default=math.nan),
                "wall_s": _num(s.get("wall_s")),
                "generated_tokens_per_s": gen_tokens / wall if wall and wall > 0 else math.nan,
                "trained_tokens_per_s": _mean(e.series("trained_tokens_per_s")),
                "step_s": _mean(e.series("step_s")),
                "val_accuracy": _num((e.validation or {}).get("accuracy")), "val_k": k, "val_pass_at_k": pk,
                "val_mean_length": _num((e.validation or {}).get("mean_length")),
                **{key: _mean(e.series(key)) for key in self.reward_components()},
            })
        return rows


def _epoch_number(path: Path) -> int | None:
    m = re.fullmatch(r"epoch_(\d+)", path.name)
    return int(m.group(1)) if m else None


def collect_run(run_dir: str | Path) -> RunData:
    root = Path(run_dir)
    dirs = sorted((p for p in root.glob("epoch_*") if p.is_dir() and _epoch_number(p) is not None),
                  key=_epoch_number)
    epochs = []
    for d in dirs:
        records = read_jsonl(d / "metrics.jsonl")
        train = sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"])
        epochs.append(EpochData(epoch=_epoch_number(d), train=train,
                                val_inline=[r for r in records if r.get("kind") == "val"],
                                summary=_read_json(d / "summary.json"), validation=_read_json(d / "validation.json")))
    return RunData(run=root.name, run_dir=root, epochs=epochs,
                   init_validation=_read_json(root / "init_validation.json"),
                   evaluation=_read_json(root / "evaluation.json"))
