"""The tracker sinks on their own, read back with each tracker's library: a restarted process
continues its W&B and MLflow runs (ids in trackers.json); the workflow's validations reach
every tracker at their RL steps and a second report replaces the first one's runs; a tracker
whose package is missing is a recipe error naming the field before anything is built; the
older `logging.tensorboard` knob still picks the trackers and may not contradict them."""

from __future__ import annotations

import json
import re

import pytest

from rl_core.errors import RecipeError

from tests.helpers.recipes import recipe
from tests.helpers.wandb_offline import history, run_file

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
ALL = ["tensorboard", "wandb", "mlflow"]


def _cfg(tmp_path, trackers=ALL):
    return recipe(output_dir=str(tmp_path), run_name="r", logging={"trackers": trackers})


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def test_a_restarted_process_continues_its_tracker_runs(tmp_path):
    from rl_core.metrics.logger import MetricsLogger

    cfg = _cfg(tmp_path, ["wandb", "mlflow"])
    run_dir = tmp_path / "r"
    ids = []
    for first in (1, 3):  # a process logs steps 1-2, is restarted, logs steps 3-4
        logger = MetricsLogger.for_run(cfg, run_dir)
        for step in (first, first + 1):
            logger.log(step, {"reward_mean": step / 10, "staleness/max": 1, "flag": True, "note": "x"})
        logger.close()
        state = json.loads((run_dir / "trackers.json").read_text())
        ids.append((state["wandb"]["id"], state["mlflow"]["run_id"]))
    assert ids[0] == ids[1]
    client = _client(state["mlflow"]["tracking_uri"])
    assert [(m.step, m.value) for m in client.get_metric_history(ids[0][1], "train/reward_mean")] == \
        [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert set(client.get_run(ids[0][1]).data.metrics) == {"train/reward_mean", "staleness/max"}  # numbers only
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))  # one directory per process, one W&B run id
    # W&B names a run's directory offline-run-<time>-<id>, with "-1" added when a second process
    # starts within the same second
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{ids[0][0]}(-\d+)?", p.name) for p in runs)
    rows = [row for p in runs for row in history(run_file(p))]
    assert [(row["rl_step"], row["train/reward_mean"]) for row in rows] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]


def test_validations_reach_every_tracker_and_a_new_report_replaces_them(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rl_core.launch.stages import log_validations

    cfg = _cfg(tmp_path)
    run_dir = tmp_path / "r"
    base = {"num_prompts": 8, "pass_at_k": {"1": 0.5}, "reward_mean": 0.4, "mean_length": 3.0,
            "truncation_rate": 0.0, "pass@1": 0.5}
    results = [{**base, "weight_version": 6, "accuracy": 0.5}, {**base, "weight_version": 0, "accuracy": 0.1}]
    log_validations(results, cfg, run_dir)
    first = json.loads((run_dir / "trackers-validation.json").read_text())
    results[0]["accuracy"] = 0.7  # a re-validation: the report runs again
    wrote = log_validations(results, cfg, run_dir)
    assert wrote[1:] == ["wandb: r/validation", "mlflow: r/validation"]
    state = json.loads((run_dir / "trackers-validation.json").read_text())
    assert state["wandb"]["id"] != first["wandb"]["id"] and state["mlflow"]["run_id"] != first["mlflow"]["run_id"]

    acc = EventAccumulator(str(run_dir / "tensorboard" / "validation"))
    acc.Reload()
    want = [(0, 0.1), (6, 0.7)]
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars("val/accuracy")] == want
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert offline == [tmp_path / "r" / "wandb" / state["wandb"]["dir"].rsplit("/", 1)[1]]  # the first one is gone
    rows = history(run_file(offline[0]))
    assert [(row["rl_step"], row["val/accuracy"]) for row in rows] == want
    assert {"val/pass@1", "val/pass_at_k/1", "val/reward_mean"} <= set(rows[0])
    client = _client(state["mlflow"]["tracking_uri"])
    from mlflow.entities import ViewType

    exp = client.get_experiment_by_name("r")
    active = client.search_runs([exp.experiment_id], run_view_type=ViewType.ACTIVE_ONLY)
    assert [r.info.run_name for r in active] == ["r/validation"] and active[0].info.run_id == state["mlflow"]["run_id"]
    assert [(m.step, m.value) for m in client.get_metric_history(state["mlflow"]["run_id"], "val/accuracy")] == want
    assert "val/pass_1" in active[0].data.metrics


def test_a_tracker_whose_package_is_missing_is_named_before_anything_is_built(tmp_path, monkeypatch):
    import importlib.util

    from rl_core.launch.preflight import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(RecipeError) as err:
        preflight(_cfg(tmp_path, ["tensorboard", "mlflow"]))
    text = str(err.value)
    assert "logging.trackers" in text and "'mlflow' package" in text and 'pip install "rl_core[mlflow]"' in text


def test_the_older_tensorboard_knob_picks_the_trackers_and_may_not_contradict_them():
    assert recipe(logging={"tensorboard": False}).logging.trackers == []
    assert recipe(logging={"tensorboard": True}).logging.trackers == ["tensorboard"]
    assert recipe().logging.trackers == ["tensorboard"] and recipe().logging.tensorboard is None
    assert recipe(logging={"tensorboard": True, "trackers": ["tensorboard", "wandb"]}).logging.trackers == \
        ["tensorboard", "wandb"]
    with pytest.raises(RecipeError, match="logging.tensorboard.*leave logging.tensorboard out"):
        recipe(logging={"tensorboard": False, "trackers": ["tensorboard", "mlflow"]})
    with pytest.raises(RecipeError, match="each tracker at most once"):
        recipe(logging={"trackers": ["wandb", "wandb"]})
