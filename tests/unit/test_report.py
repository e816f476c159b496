"""The run report: plots and HTML from a run directory's result files (synthetic here)."""

from __future__ import annotations

import base64
import io
import json
import math
import re

import matplotlib.image as mpimg

from rl_core.report import build_report, collect_run
from rl_core.report.render import PLOT_TITLES


def _run_dir(tmp_path, epochs=2, steps_per_epoch=5, with_eval=True):
    run = tmp_path / "results" / "demo"
    step = 0
    for k in range(1, epochs + 1):
        d = run / f"epoch_{k}"
        d.mkdir(parents=True)
        lines = []
        for _ in range(steps_per_epoch):
            step += 1
            lines.append({"kind": "train", "step": step, "train/reward_mean": 0.1 * step, "train/accuracy": 0.05 * step,
                          "staleness/mean": 0.8, "staleness/max": 1, "throughput/generated_tokens_per_s": 1000.0,
                          "throughput/trained_tokens_per_s": 800.0 + step, "timing/step_s": 0.5, "epoch": k - 1})
        lines.append({"kind": "val", "step": step, "val/accuracy": 0.3 * k})
        lines.append("{cut by a kill")
        (d / "metrics.jsonl").write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
        (d / "summary.json").write_text(json.dumps({"generated_tokens": 5000, "wall_s": 10.0, "pumps_s": 5.0}))
        (d / "validation.json").write_text(json.dumps({"accuracy": 0.3 * k, "pass@1": 0.3 * k, "mean_length": 4.0}))
    (run / "init_validation.json").write_text(json.dumps({"accuracy": 0.1, "pass@1": 0.1}))
    if with_eval:
        (run / "evaluation.json").write_text(json.dumps({"k": 4, "results": [
            {"epoch": epochs, "labels": ["final", "best"], "set": "val", "accuracy": 0.5, "pass@4": 0.8,
             "mean_length": 4.0, "num_prompts": 64}]}))
    return run


def test_collect_series_and_per_epoch(tmp_path):
    data = collect_run(_run_dir(tmp_path))
    assert data.steps() == list(range(1, 11))
    assert data.epoch_boundaries() == [5]
    rows = data.per_epoch()
    assert [r["epoch"] for r in rows] == [1, 2]
    assert rows[0]["reward"] == sum(0.1 * s for s in range(1, 6)) / 5
    assert rows[1]["val_accuracy"] == 0.6 and rows[1]["val_k"] == 1
    assert rows[0]["generated_tokens_per_s"] == 1000.0  # 5000 tokens / 5 s of pumps
    assert rows[0]["staleness_max"] == 1


def test_report_has_every_plot_embedded_and_on_disk(tmp_path):
    run = _run_dir(tmp_path)
    out = run / "report.html"
    info = build_report(run, out)
    text = out.read_text()
    uris = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert len(uris) == len(PLOT_TITLES) == 5
    for name, b64 in zip(PLOT_TITLES, uris):
        png = (run / "report" / f"{name}.png").read_bytes()
        assert base64.b64decode(b64) == png
        img = mpimg.imread(io.BytesIO(png), format="png")
        assert img.shape[0] > 200 and img.shape[1] > 500  # a real figure, not an empty image
        assert f'id="{name}"' in text
    assert "Evaluation (k = 4)" in text and "final/best" in text
    assert info["epochs"] == 2 and info["steps"] == 10


def test_report_of_a_partial_run_still_renders(tmp_path):
    run = _run_dir(tmp_path, epochs=1, with_eval=False)
    (run / "epoch_1" / "validation.json").unlink()
    (run / "epoch_2").mkdir()  # started, nothing written yet
    build_report(run, run / "report.html")
    text = (run / "report.html").read_text()
    assert text.count("data:image/png;base64,") == 5
    assert "no evaluation.json" not in text  # the message is drawn into the PNG, not the HTML
    data = collect_run(run)
    assert math.isnan(data.per_epoch()[0]["val_accuracy"]) and data.per_epoch()[1]["num_steps"] == 0


def test_report_shows_the_recipe_its_files_and_overrides(tmp_path):
    import html

    from rl_core.report import RecipeShown

    run = _run_dir(tmp_path, epochs=1)
    base = "run_name: demo\ntrainer: {lr: 1.0e-4}\n"
    child = "extends: base.yaml\ngrpo: {max_num_steps: 5}  # <short>\n"
    shown = RecipeShown(path="recipes/child.yaml", overrides=["trainer.lr=3e-4", "logging.tensorboard=false"],
                        files={"recipes/child.yaml": child, "recipes/base.yaml": base},
                        resolved=json.dumps({"trainer": {"lr": 3e-4}}, indent=2))
    build_report(run, run / "report.html", recipe=shown)
    text = (run / "report.html").read_text()
    assert "<h2>Recipe</h2>" in text and "<code>recipes/child.yaml</code>" in text
    assert "<li><code>trainer.lr=3e-4</code></li><li><code>logging.tensorboard=false</code></li>" in text
    assert html.escape(child) in text and html.escape(base) in text  # escaped: `<short>` is text, not a tag
    assert "<short>" not in text and '&quot;lr&quot;: 0.0003' in text
    build_report(run, run / "plain.html")  # without a recipe (a run folder alone): no such section
    assert "<h2>Recipe</h2>" not in (run / "plain.html").read_text()
