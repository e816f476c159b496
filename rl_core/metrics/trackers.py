"""Experiment-tracker sinks: TensorBoard, Weights & Biases and MLflow, each through its own library.

Owns: the one sink interface (`write(step, scalars, histograms)`, `close()`) that
`MetricsLogger` fans out to, opening the sinks a recipe's `logging.trackers` lists, where
their files go (under the run folder <output_dir>/<run_name>/: `wandb/`, `mlruns/`; each
process's TensorBoard events under its own run dir), and resuming the same tracker run
after a restart (ids kept in <run dir>/trackers.json). Every sink gets the same scalars at
the same RL step; W&B plots them against `rl_step`, MLflow spells a name's characters it
refuses (anything but letters, digits, `_ - . : /` and space) as `_` (`val/pass@4` is
`val/pass_4`). Histograms reach TensorBoard only.

Does not own: what is measured (the pumps), metrics.jsonl (logger.py). See
docs/controller.md, "Metrics and trackers".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

STATE_FILE = "trackers.json"
_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. :/]")


class Sink(Protocol):
    def write(self, step: int, scalars: dict[str, float], histograms: dict[str, list[float]]) -> None: ...

    def close(self) -> None: ...


def mlflow_key(name: str) -> str:
    """The metric name MLflow stores for `name` (characters it refuses become `_`)."""
    return _MLFLOW_BAD.sub("_", name)


class TensorBoardSink:
    def __init__(self, log_dir: str | Path, filename_suffix: str = ""):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir), filename_suffix=filename_suffix)

    def write(self, step, scalars, histograms) -> None:
        import numpy as np

        for name, values in histograms.items():
            if values:
                self._writer.add_histogram(name, np.asarray(values, dtype=np.float64), step)
        for k, v in scalars.items():
            self._writer.add_scalar(k, v, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """One W&B run; `resume_id` continues an earlier process's run (same id)."""

    def __init__(self, settings: Any, home: Path, name: str, group: str, job_type: str, config: dict,
                 resume_id: str | None = None):
        import wandb

        self._run = wandb.init(
            project=settings.project, entity=settings.entity, mode=settings.mode, dir=str(home), name=name,
            group=group, job_type=job_type, tags=list(settings.tags) or None, config=config, id=resume_id,
            resume="allow" if resume_id else None, reinit="create_new",
            settings=wandb.Settings(console="off", silent=True))
        self._run.define_metric("rl_step")
        self._run.define_metric("*", step_metric="rl_step")
        self.id = self._run.id
        self.dir = Path(self._run.dir).parent  # offline-run-<time>-<id> (or run-...): this process's files

    def write(self, step, scalars, histograms) -> None:
        if scalars:
            self._run.log({**scalars, "rl_step": step})

    def close(self) -> None:
        self._run.finish()


def _flat(d: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, dict)) or v is None else str(v)
    return out


class MlflowSink:
    """One MLflow run in `uri`; `resume_id` continues an earlier process's run."""

    def __init__(self, uri: str, experiment: str, name: str, tags: dict[str, str], config: dict,
                 resume_id: str | None = None):
        if uri.startswith("file:"):  # MLflow 3 keeps the file store behind an opt-in (it still reads and writes it)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        if resume_id is not None:
            self.id = resume_id
            self._client.update_run(resume_id, status="RUNNING")
            return
        exp = self._client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(experiment)
        self.id = self._client.create_run(exp_id, run_name=name, tags=tags).info.run_id
        flat = {mlflow_key(k): v[:6000] for k, v in _flat(config).items()}  # user keys (env.config) too
        params = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(params), 100):  # MLflow's limit of params per batch
            self._client.log_batch(self.id, params=params[i:i + 100])
        self._client.log_dict(self.id, config, "resolved_config.json")

    def write(self, step, scalars, histograms) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), float(v), now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's limit of metrics per batch
            self._client.log_batch(self.id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self._client.set_terminated(self.id, "FINISHED")

    @staticmethod
    def delete_run(uri: str, run_id: str) -> None:
        """Mark an earlier run deleted (MLflow keeps it in its trash until `mlflow gc`)."""
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            MlflowClient(tracking_uri=uri).delete_run(run_id)
        except MlflowException:
            pass  # already gone


def tracker_home(cfg: Any, run_dir: Path) -> Path:
    """The run folder (<output_dir>/<run_name>) when `run_dir` is in it (a workflow epoch, or
    `rl-core train`'s own folder), else `run_dir` itself."""
    home = Path(cfg.output_dir) / cfg.run_name
    try:
        run_dir.resolve().relative_to(home.resolve())
        return home
    except ValueError:
        return run_dir


def open_sinks(cfg: Any, run_dir: str | Path, *, trackers: list[str] | None = None, name: str | None = None,
               state_file: str = STATE_FILE, job_type: str = "train", replace: bool = False) -> list[Sink]:
    """The sinks of `trackers` (default `cfg.logging.trackers`) for the process that writes `run_dir`.

    Tracker runs are named after `run_dir` within the run folder (`<run_name>`, or
    `<run_name>/epoch_2`; or `name`) and grouped by run_name (W&B group, MLflow experiment).
    Their ids are kept in `run_dir/<state_file>`, so a restarted process continues the same
    runs; `replace`: drop the runs an earlier call recorded there instead (W&B offline files
    and MLflow runs rl_core made) and start new ones."""
    run_dir = Path(run_dir)
    trackers = cfg.logging.trackers if trackers is None else trackers
    if not trackers:
        return []
    home = tracker_home(cfg, run_dir)
    rel = run_dir.resolve().relative_to(home.resolve()).as_posix() if home != run_dir else "."
    name = name or (cfg.run_name if rel == "." else f"{cfg.run_name}/{rel}")
    state_path = run_dir / state_file
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    config = cfg.model_dump(mode="json")
    sinks: list[Sink] = []
    new_state: dict[str, Any] = {}
    try:
        if "tensorboard" in trackers:
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        if "wandb" in trackers:
            old = state.get("wandb") or {}
            if replace and old.get("dir") and cfg.logging.wandb.mode == "offline":
                shutil.rmtree(old["dir"], ignore_errors=True)  # the offline files rl_core wrote for that run
            sink = WandbSink(cfg.logging.wandb, home, name, cfg.run_name, job_type, config,
                             None if replace else old.get("id"))
            sinks.append(sink)
            new_state["wandb"] = {"id": sink.id, "dir": str(sink.dir)}
        if "mlflow" in trackers:
            uri = cfg.logging.mlflow.tracking_uri or (home / "mlruns").resolve().as_uri()
            old = state.get("mlflow") or {}
            same = old.get("tracking_uri") == uri
            sink = MlflowSink(uri, cfg.logging.mlflow.experiment or cfg.run_name, name,
                              {"rl_core.run_name": cfg.run_name, "rl_core.job_type": job_type}, config,
                              old.get("run_id") if same and not replace else None)
            if replace and same and old.get("run_id"):
                MlflowSink.delete_run(uri, old["run_id"])
            sinks.append(sink)
            new_state["mlflow"] = {"run_id": sink.id, "tracking_uri": uri}
    except BaseException:
        for s in sinks:
            s.close()
        raise
    if new_state:
        from rl_core.fsutil import atomic_write_json

        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(state_path, {**state, **new_state})
    return sinks
