"""Drawing the report: five PNG plots (per RL step and per epoch) and a self-contained HTML page.

Owns: the plots (matplotlib with the Agg backend: no display needed) - `reward` (the
total and its named components), `accuracy`, `pass_at_k`, `staleness`, `throughput`, each a
figure with a per-step panel (epoch boundaries dashed) and a per-epoch panel - written as
PNG files and embedded in `report.html` as data URIs, plus the tables (run summary, per
epoch, evaluation) and the recipe it was drawn with (its files, the overrides, the resolved
recipe: `RecipeShown`). Writes are atomic.

Does not own: reading result files (collect.py).
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_core.fsutil import atomic_write_text
from rl_core.report.collect import RunData, collect_run, pass_at

PLOT_TITLES = {
    "reward": "Reward",
    "accuracy": "Accuracy (train samples, held-out validation)",
    "pass_at_k": "pass@k (validation per epoch, evaluation per checkpoint)",
    "staleness": "Staleness (trainer version - version at dispatch)",
    "throughput": "Throughput",
}
PLOTS = tuple(PLOT_TITLES)  # the report's PNGs, in order (the workflow's report rule lists them as outputs)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _clean(xs, ys):
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None and not math.isnan(y)]
    return [p[0] for p in pts], [p[1] for p in pts]


def _rolling(ys: list[float], window: int) -> list[float]:
    out, acc = [], []
    for y in ys:
        acc.append(y)
        if len(acc) > window:
            acc.pop(0)
        vals = [v for v in acc if not math.isnan(v)]
        out.append(sum(vals) / len(vals) if vals else math.nan)
    return out


def _step_panel(ax, data: RunData, series: list[tuple[str, str]], ylabel: str, smooth: bool = False) -> None:
    steps = data.steps()
    window = max(1, len(steps) // 20)
    for name, label in series:
        xs, ys = _clean(steps, data.series(name))
        if not xs:
            continue
        line, = ax.plot(xs, ys, lw=0.8, alpha=0.45 if smooth and window > 1 else 1.0, label=label)
        if smooth and window > 1:
            ax.plot(xs, _rolling(ys, window), lw=1.6, color=line.get_color(), label=f"{label} (mean of {window})")
    for b in data.epoch_boundaries():
        ax.axvline(b + 0.5, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    ax.set_title("per RL step (dashed: epoch ends)", fontsize=9)
    if ax.lines:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no per-step data", ha="center", va="center", transform=ax.transAxes)


def _epoch_panel(ax, rows: list[dict], keys: list[tuple[str, str]], ylabel: str) -> None:
    for key, label in keys:
        xs, ys = _clean([r["epoch"] for r in rows], [r[key] for r in rows])
        if xs:
            ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.set_title("per epoch", fontsize=9)
    ax.set_xticks([r["epoch"] for r in rows] or [0])
    if ax.lines:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no per-epoch data", ha="center", va="center", transform=ax.transAxes)


def _figure(name: str, data: RunData) -> bytes:
    plt = _plt()
    rows = data.per_epoch()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    fig.suptitle(PLOT_TITLES[name])
    if name == "reward":  # the total and each named component (`reward/<name>`)
        series = [("reward", "mean reward")] + [(key, key) for key in data.reward_components()]
        _step_panel(left, data, series, "reward", smooth=True)
        _epoch_panel(right, rows, series, "reward")
    elif name == "accuracy":
        _step_panel(left, data, [("accuracy", "train accuracy")], "accuracy", smooth=True)
        labelled = False
        for e in data.epochs:  # in-training validations, at the weight version they saw
            xs, ys = _clean([r["step"] for r in e.val_inline], [r.get("val/accuracy") for r in e.val_inline])
            if xs:
                left.plot(xs, ys, "s", ms=4, color="tab:red",
                          label=None if labelled else "held-out validation (during training)")
                labelled = True
        if labelled:
            left.legend(fontsize=7)
        _epoch_panel(right, rows, [("accuracy", "train accuracy (mean)"), ("val_accuracy", "validation accuracy")],
                     "accuracy")
        if data.init_validation:
            right.axhline(data.init_validation["accuracy"], color="grey", ls=":", label="before RL")
            right.legend(fontsize=7)
    elif name == "pass_at_k":
        k = next((r["val_k"] for r in rows if r["val_k"]), None)
        _epoch_panel(left, rows, [("val_pass_at_k", f"validation pass@{k}"), ("val_accuracy", "validation accuracy")],
                     "rate")
        left.set_title("validation per epoch", fontsize=9)
        ev = (data.evaluation or {}).get("results", [])
        if ev:
            ke = data.evaluation.get("k")
            labels = [f"e{r['epoch']} {'/'.join(r['labels'])}\n{r['set']}" for r in ev]
            xs = range(len(ev))
            right.bar([x - 0.2 for x in xs], [r["accuracy"] for r in ev], 0.4, label="accuracy")
            right.bar([x + 0.2 for x in xs], [r.get(f"pass@{ke}", math.nan) for r in ev], 0.4, label=f"pass@{ke}")
            right.set_xticks(list(xs), labels, fontsize=7)
            right.set_xlim(-0.8, len(ev) - 0.2)
            right.set_ylim(0, 1.05)
            right.legend(fontsize=7)
        else:
            right.text(0.5, 0.5, "no evaluation.json", ha="center", va="center", transform=right.transAxes)
        right.set_title("evaluation (checkpoint x set)", fontsize=9)
    elif name == "staleness":
        _step_panel(left, data, [("staleness_mean", "mean"), ("staleness_max", "max")], "versions")
        _epoch_panel(right, rows, [("staleness_mean", "mean"), ("staleness_max", "max")], "versions")
    elif name == "throughput":
        _step_panel(left, data, [("trained_tokens_per_s", "trained tokens/s (this step)"),
                                 ("generated_tokens_per_s", "generated tokens/s (since start)")], "tokens / s")
        _epoch_panel(right, rows, [("generated_tokens_per_s", "generated tokens/s"),
                                   ("trained_tokens_per_s", "trained tokens/s (mean of steps)")], "tokens / s")
    else:
        raise ValueError(f"unknown plot {name!r}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "/".join(map(str, v))
    return html.escape(str(v))


def _table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in cols)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(r.get(key))}</td>" for key, _ in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


@dataclass
class RecipeShown:
    """The recipe a report shows: `path` (as the workflow config names it), the `overrides`, the
    text of each file of its `extends:` chain (path -> YAML) and the resolved recipe (JSON text)."""

    path: str
    overrides: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    resolved: str | None = None


def _recipe_html(recipe: RecipeShown) -> str:
    overrides = ("".join(f"<li><code>{html.escape(o)}</code></li>" for o in recipe.overrides)
                 if recipe.overrides else "<li>none</li>")
    parts = [f"<h2>Recipe</h2><p>recipe <code>{html.escape(recipe.path)}</code>, overrides:</p><ul>{overrides}</ul>"]
    for path, text in recipe.files.items():
        parts.append(f"<details><summary><code>{html.escape(path)}</code></summary><pre>{html.escape(text)}</pre>"
                     "</details>")
    if recipe.resolved is not None:
        parts.append("<details><summary>resolved recipe (every field, overrides applied)</summary>"
                     f"<pre>{html.escape(recipe.resolved)}</pre></details>")
    return "".join(parts)


def _html(data: RunData, images: dict[str, bytes], recipe: RecipeShown | None = None) -> str:
    rows = data.per_epoch()
    init = data.init_validation or {}
    last = rows[-1] if rows else {}
    best = max(rows, key=lambda r: (-math.inf if math.isnan(r["val_accuracy"]) else r["val_accuracy"], r["epoch"]),
               default={})
    k = next((r["val_k"] for r in rows if r["val_k"]), None)
    summary = [
        ("run", data.run), ("epochs", len(rows)), ("RL steps", len(data.steps())),
        ("validation accuracy before RL", init.get("accuracy")),
        ("validation accuracy after the last epoch", last.get("val_accuracy")),
        (f"validation pass@{k} after the last epoch", last.get("val_pass_at_k")),
        ("best epoch (validation accuracy)", best.get("epoch")),
        ("training wall time (s)", sum(r["wall_s"] for r in rows if not math.isnan(r["wall_s"]))),
    ]
    parts = [f"<h1>rl_core run <code>{html.escape(data.run)}</code></h1>",
             "<table>" + "".join(f"<tr><th>{html.escape(a)}</th><td>{_fmt(b)}</td></tr>" for a, b in summary)
             + "</table>", _recipe_html(recipe) if recipe is not None else "", "<h2>Plots</h2>"]
    for name, png in images.items():
        b64 = base64.b64encode(png).decode()
        parts.append(f'<figure id="{name}"><img alt="{html.escape(PLOT_TITLES[name])}" '
                     f'src="data:image/png;base64,{b64}"><figcaption>{html.escape(PLOT_TITLES[name])} '
                     f'(<a href="report/{name}.png">{name}.png</a>)</figcaption></figure>')
    parts.append("<h2>Per epoch</h2>" + _table(rows, [
        ("epoch", "epoch"), ("num_steps", "steps"), ("reward", "mean reward"),
        *[(key, key) for key in data.reward_components()], ("accuracy", "train accuracy"),
        ("val_accuracy", "val accuracy"), ("val_pass_at_k", f"val pass@{k}"), ("val_mean_length", "val length"),
        ("staleness_mean", "staleness mean"), ("staleness_max", "staleness max"),
        ("generated_tokens_per_s", "generated tok/s"), ("trained_tokens_per_s", "trained tok/s"),
        ("step_s", "s / step"), ("wall_s", "wall s")]))
    ev = data.evaluation or {}
    if ev.get("results"):
        ke = ev.get("k")
        parts.append(f"<h2>Evaluation (k = {ke})</h2>" + _table(ev["results"], [
            ("epoch", "epoch"), ("labels", "checkpoint"), ("set", "set"), ("accuracy", "accuracy"),
            (f"pass@{ke}", f"pass@{ke}"), ("mean_length", "mean length"), ("num_prompts", "prompts")]))
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse;"
             "margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}img{max-width:100%}"
             "pre{background:#f6f6f6;padding:6px;overflow-x:auto;font-size:85%}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>rl_core report: {html.escape(data.run)}"
            f"</title><style>{style}</style></head><body>{''.join(parts)}</body></html>\n")


def build_report(run_dir: str | os.PathLike, out_html: str | os.PathLike,
                 plots_dir: str | os.PathLike | None = None, recipe: RecipeShown | None = None) -> dict[str, Any]:
    """Write `out_html` (plots embedded, `recipe` shown when given) and the PNGs under `plots_dir`
    (default <run_dir>/report)."""
    data = collect_run(run_dir)
    plots = Path(plots_dir) if plots_dir else Path(run_dir) / "report"
    plots.mkdir(parents=True, exist_ok=True)
    images = {name: _figure(name, data) for name in PLOTS}
    for name, png in images.items():
        tmp = plots / f".{name}.png.tmp{os.getpid()}"
        tmp.write_bytes(png)
        os.replace(tmp, plots / f"{name}.png")
    atomic_write_text(out_html, _html(data, images, recipe))
    k, _ = pass_at(data.epochs[-1].validation if data.epochs else None)
    return {"html": str(out_html), "plots": [str(plots / f"{n}.png") for n in images], "epochs": len(data.epochs),
            "steps": len(data.steps()), "val_k": k}
