"""Experiment trackers and model cards, read back with the tools users read them with.

A short run of the tiny recipe with `logging.trackers: [tensorboard, wandb, mlflow]` (W&B
offline, MLflow's file store in the run folder: no network) leaves the same scalars at the
same RL steps in all three, each read with its own library (TensorBoard's
EventAccumulator, wandb's protobuf records of the offline run, MlflowClient); the final
policy and every step checkpoint carry a model card that `huggingface_hub.ModelCard.load`
parses, and the checkpoints still verify against their manifests."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest

from tests.helpers.paths import ROOT, TINY_RECIPE
from tests.helpers.wandb_offline import history, run_file

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytestmark = pytest.mark.timeout(900)
STEPS = 4


def _tensorboard(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb(run_dir) -> dict[str, list[tuple[int, float]]]:
    out = defaultdict(list)
    for row in history(run_file(run_dir)):
        for key, value in row.items():
            if key != "rl_step" and not key.startswith("_"):
                out[key].append((row["rl_step"], value))
    return dict(out)


def _mlflow(uri: str, run_id: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    return run, {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in run.data.metrics}


def _same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    a, b = sorted(a), sorted(b)
    return len(a) == len(b) and all(sa == sb and math.isclose(va, vb, rel_tol=1e-6, abs_tol=1e-6)
                                    for (sa, va), (sb, vb) in zip(a, b))


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    import os

    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import train_from_recipe

    tmp = tmp_path_factory.mktemp("trackers")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        cfg = load_recipe(TINY_RECIPE, [f"output_dir={tmp}", "run_name=tracked", f"grpo.max_num_steps={STEPS}",
                                        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
                                        "validation.max_val_samples=16", "validation.val_period=2",
                                        "checkpoint.save_every_steps=2", "checkpoint.keep_last=4",
                                        "logging.progress=off", "logging.trackers=[tensorboard,wandb,mlflow]",
                                        "model.warmup.enabled=false"])  # the trackers, not learning, are tested
        run_dir = tmp / "tracked"
        summary = train_from_recipe(cfg)
    finally:
        os.chdir(cwd)
    return cfg, run_dir, summary


def test_wandb_offline_and_mlflow_file_store_hold_the_scalars_tensorboard_holds(tracked_run):
    from rl_core.metrics.trackers import mlflow_key

    cfg, run_dir, _ = tracked_run
    state = json.loads((run_dir / "trackers.json").read_text())
    tb = _tensorboard(run_dir / "tensorboard")
    wb = _wandb(state["wandb"]["dir"])
    assert str(run_dir / "wandb") in state["wandb"]["dir"]  # under the run folder
    uri = state["mlflow"]["tracking_uri"]
    assert uri == (run_dir / "mlruns").resolve().as_uri()
    run, ml = _mlflow(uri, state["mlflow"]["run_id"])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["grpo.max_num_steps"] == str(STEPS)  # the recipe as the run's parameters

    assert {"train/reward_mean", "train/accuracy", "val/accuracy", "timing/setup/total_s"} <= set(tb)
    assert [s for s, _ in tb["train/reward_mean"]] == list(range(1, STEPS + 1))
    assert [s for s, _ in tb["val/accuracy"]] == [0, 2, STEPS]  # start, val_period, end
    assert set(wb) == set(tb)
    assert set(ml) == {mlflow_key(k) for k in tb} and "val/pass_1" in ml  # `val/pass@1`, spelled as MLflow allows
    for key, points in tb.items():
        assert _same(points, wb[key]), (key, points, wb[key])
        assert _same(points, ml[mlflow_key(key)]), (key, points, ml[mlflow_key(key)])


def test_the_final_policy_and_each_checkpoint_carry_a_model_card(tracked_run):
    from huggingface_hub import ModelCard

    from rl_core.checkpoint import read_manifest, verify_checkpoint
    from rl_core.metrics.logger import read_jsonl

    cfg, run_dir, summary = tracked_run
    held_out = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl", "val")}
    assert sorted(held_out) == [0, 2, STEPS]
    card = ModelCard.load(run_dir / "final_policy" / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert card.data.base_model is None  # the tiny model is trained from scratch, not from a Hub model
    assert {"rl_core", "reinforcement-learning", "grpo", "env-addition"} <= set(card.data.tags)
    assert f"# tracked, RL step {STEPS}" in card.text and "## Recipe" in card.text
    assert "tiny random-init qwen2 model (hidden size 128, 2 layers)" in card.text  # no warm-up in this run
    assert "environment `addition`" in card.text and "| prompts x samples per RL step | 4 x 4 |" in card.text
    end = summary["val_end"]["accuracy"]
    assert end == held_out[STEPS]["val/accuracy"]
    assert f"held-out accuracy: {end:.4f} on 16 prompts (pass@1 {end:.4f}), weight version {STEPS}" in card.text

    steps = sorted((run_dir / "steps").glob("step_*"))
    assert [p.name for p in steps] == ["step_000002", "step_000004"]
    for ck in steps:
        verify_checkpoint(ck)  # the card is one of the files the manifest lists and hashes
        assert "model/README.md" in read_manifest(ck)["files"]
    mid = ModelCard.load(steps[0] / "model" / "README.md")  # validated at step 2 (val_period) before it was saved
    assert "# tracked, RL step 2" in mid.text
    assert f"held-out accuracy: {held_out[2]['val/accuracy']:.4f} on 16 prompts" in mid.text
    last = ModelCard.load(steps[1] / "model" / "README.md")  # saved before the end-of-run validation
    assert f"# tracked, RL step {STEPS}" in last.text and "held-out accuracy: not measured" in last.text
