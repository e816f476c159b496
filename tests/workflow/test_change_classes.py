"""Change detection in one invocation: each documented change class, as a single `snakemake` run
on a copy of the finished reference run, reruns exactly the stages it can change; a dry run
afterwards has nothing to do, and the accuracy line printed at the end is the new one.
Also: `snakemake --report` of the finished run holds its plots, and docs/workflow.md's branch
command does not rebuild the initial policy."""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from pathlib import Path

from tests.helpers.workflow import PLOTS, ROOT, RUN, copy_run, job_stats, short_config, snakemake

EPOCHS = 2


def _outputs(wd: Path) -> dict[str, Path]:
    r = wd / "results" / RUN
    out = {"resolved": r / "resolved_config.json", "init_policy": r / "init_policy" / "model.safetensors",
           "init_validation": r / "init_validation.json", "evaluation": r / "evaluation.json",
           "report": r / "report.html"}
    for k in range(1, EPOCHS + 1):
        out[f"checkpoint_{k}"] = r / f"epoch_{k}" / "checkpoint" / "manifest.json"
        out[f"rollouts_{k}"] = r / f"epoch_{k}" / "rollouts.h5"
        out[f"validation_{k}"] = r / f"epoch_{k}" / "validation.json"
    return out


def _mtimes(wd: Path) -> dict[str, int]:
    return {name: p.stat().st_mtime_ns for name, p in _outputs(wd).items()}


def _changed(before: dict[str, int], wd: Path) -> set[str]:
    return {name for name, t in _mtimes(wd).items() if t != before[name]}


def _run_once(reference_run, tmp_path, overrides: list[str]) -> tuple[Path, dict[str, int], set[str], str]:
    """Copy the reference run, run `snakemake` once with `overrides`, then check a dry run has
    nothing to do. Returns the workdir, the jobs that ran, the outputs rewritten and the output."""
    wd = copy_run(reference_run, tmp_path / "wd")
    before = _mtimes(wd)
    args = ["--cores", "2", *short_config(RUN, overrides)]
    out = snakemake(wd, *args, check=True)
    text = out.stdout + out.stderr
    ran = job_stats(text)
    again = snakemake(wd, "-n", *args, check=True)
    assert "Nothing to be done" in again.stdout + again.stderr, again.stdout[-3000:] + again.stderr[-3000:]
    return wd, ran, _changed(before, wd), text


def _accuracy(path: Path) -> float:
    return float(json.loads(path.read_text())["accuracy"])


def _final_line_is_current(wd: Path, text: str) -> None:
    r = wd / "results" / RUN
    m = re.search(r"held-out accuracy: ([0-9.]+) before RL -> ([0-9.]+) after", text)
    assert m, text[-3000:]
    assert (float(m.group(1)), float(m.group(2))) == (round(_accuracy(r / "init_validation.json"), 3),
                                                      round(_accuracy(r / f"epoch_{EPOCHS}" / "validation.json"), 3))


def test_a_trainer_knob_retrains_and_reruns_everything_after(reference_run, tmp_path):
    wd, ran, changed, text = _run_once(reference_run, tmp_path, ["trainer.lr=3e-4"])
    assert ran == {"validate_recipe": 1, "train_epoch": 2, "archive_rollouts": 2, "validate_epoch": 2,
                   "evaluate": 1, "report": 1, "all": 1}, text[-3000:]
    assert changed == set(_outputs(wd)) - {"init_policy", "init_validation"}
    r, ref = wd / "results" / RUN, reference_run / "results" / RUN
    assert json.loads((r / "resolved_config.json").read_text())["trainer"]["lr"] == 3e-4
    new, old = (json.loads((d / "epoch_2" / "checkpoint" / "manifest.json").read_text()) for d in (r, ref))
    assert new["files"]["model/model.safetensors"]["sha256"] != old["files"]["model/model.safetensors"]["sha256"]
    _final_line_is_current(wd, text)


def test_a_validation_knob_revalidates_without_retraining(reference_run, tmp_path):
    # logging is in no stage's digest: turning TensorBoard on reruns nothing by itself
    wd, ran, changed, text = _run_once(reference_run, tmp_path,
                                       ["validation.sampling.max_tokens=3", "logging.tensorboard=true"])
    # evaluate follows the validations: it evaluates the best checkpoint by validation accuracy
    assert ran == {"validate_recipe": 1, "validate_init": 1, "validate_epoch": 2, "evaluate": 1, "report": 1,
                   "all": 1}, text[-3000:]
    assert changed == {"resolved", "init_validation", "validation_1", "validation_2", "evaluation", "report"}
    r = wd / "results" / RUN
    for path in (r / "init_validation.json", r / "epoch_1" / "validation.json", r / "epoch_2" / "validation.json"):
        assert json.loads(path.read_text())["mean_length"] <= 3
    _final_line_is_current(wd, text)
    # TensorBoard: the before-RL and end-of-epoch validations at their RL steps, one curve
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(r / "tensorboard" / "validation"))
    acc.Reload()
    want = [(0, r / "init_validation.json"), (6, r / "epoch_1" / "validation.json"),
            (12, r / "epoch_2" / "validation.json")]
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("val/accuracy")] == \
        [(step, round(_accuracy(path), 6)) for step, path in want]


def test_a_new_evaluation_set_reevaluates_only(reference_run, tmp_path):
    overrides = ["evaluation.sets.heldout=data/addition/val.jsonl"]
    wd = copy_run(reference_run, tmp_path / "plan")
    # a dry run of the change, then of the run as it was: the abandoned plan leaves nothing to do
    plan = snakemake(wd, "-n", "--cores", "2", *short_config(RUN, overrides), check=True)
    assert job_stats(plan.stdout) == {"validate_recipe": 1, "evaluate": 1, "report": 1, "all": 1}, plan.stdout
    back = snakemake(wd, "-n", "--cores", "2", *short_config(RUN), check=True)
    assert "Nothing to be done" in back.stdout + back.stderr, back.stdout[-3000:]

    wd, ran, changed, text = _run_once(reference_run, tmp_path, overrides)
    assert ran == {"validate_recipe": 1, "evaluate": 1, "report": 1, "all": 1}, text[-3000:]
    assert changed == {"resolved", "evaluation", "report"}
    ev = json.loads((wd / "results" / RUN / "evaluation.json").read_text())
    assert {row["set"] for row in ev["results"]} == {"heldout"}
    _final_line_is_current(wd, text)


def test_a_cluster_resource_reruns_no_stage(reference_run, tmp_path):
    wd, ran, changed, text = _run_once(reference_run, tmp_path, ["cluster.controller.mem_gb=8"])
    # only the recipe of record is rewritten (seconds, no model is loaded)
    assert ran == {"validate_recipe": 1, "all": 1}, text[-3000:]
    assert changed == {"resolved"}
    assert json.loads(_outputs(wd)["resolved"].read_text())["cluster"]["controller"]["mem_gb"] == 8


def test_snakemake_report_holds_the_plots(reference_run, tmp_path):
    wd = copy_run(reference_run, tmp_path / "wd")
    snakemake(wd, "--report", "report.zip", *short_config(), check=True)
    r = wd / "results" / RUN
    with zipfile.ZipFile(wd / "report.zip") as z:
        files = {Path(n).name: n for n in z.namelist() if "/data/raw/" in n}  # report/data/raw/<id>/<file>
        for plot in PLOTS:
            assert z.read(files[f"{plot}.png"]) == (r / "report" / f"{plot}.png").read_bytes(), plot
        assert z.read(files["report.html"]) == (r / "report.html").read_bytes()
        assert z.read(files["evaluation.json"]) == (r / "evaluation.json").read_bytes()
        assert "init_validation.json" in files and "validation.json" in files
        page = z.read("report/report.html").decode()
    assert f"rl_core run <tt class=\\\"docutils literal\\\">{RUN}</tt>" in page  # the workflow description
    for name in ("Plots", "Validation", "Evaluation", "reward.png", "train_epoch"):
        assert name in page, name


def test_branch_command_of_the_readme_links_the_initial_policy(reference_run, tmp_path):
    """docs/workflow.md, rerun (a) with the default target: the initial policy and epoch 1 are the source's
    (payload hard-linked), epoch 2 trains with the new knob, then nothing is left to do."""
    wd = copy_run(reference_run, tmp_path / "wd")
    args = ["--cores", "2", *short_config("lr-branch", ["trainer.lr=3e-4"], f"branch_from=results/{RUN}/epoch_1")]
    out = snakemake(wd, *args, check=True)
    ran = job_stats(out.stdout + out.stderr)
    assert ran.get("branch_init_policy") == 1 and "init_policy" not in ran, ran
    # the initial policy is the source's, and so is its before-RL validation (same validation knobs)
    assert (ran["branch_epoch"], ran["train_epoch"], ran["branch_init_validation"]) == (1, 1, 1), ran
    assert "validate_init" not in ran, ran
    src, b = wd / "results" / RUN, wd / "results" / "lr-branch"
    for rel in ("init_policy/model.safetensors", "epoch_1/checkpoint/model/model.safetensors"):
        assert (b / rel).stat().st_ino == (src / rel).stat().st_ino, rel
    assert json.loads((b / "epoch_2" / "checkpoint" / "resolved_config.json").read_text())["trainer"]["lr"] == 3e-4
    assert "held-out accuracy:" in out.stdout and (b / "report.html").is_file()
    again = snakemake(wd, "-n", *args, check=True)
    assert "Nothing to be done" in again.stdout + again.stderr, again.stdout[-3000:]


def test_a_data_file_edited_in_place_reruns_the_stages_that_read_it(reference_run, tmp_path):
    """The digests hold data file paths; the files themselves are the stages' inputs, so an edit
    in place (same path) plans every stage that reads the file, and only those."""
    wd = copy_run(reference_run, tmp_path / "wd")
    (wd / "data").unlink()
    shutil.copytree(ROOT / "data", wd / "data")  # copy2: the copies keep their (older) mtimes
    args = ["-n", "--cores", "2", *short_config()]
    assert "Nothing to be done" in (lambda o: o.stdout + o.stderr)(snakemake(wd, *args, check=True))
    val = wd / "data" / "addition" / "val.jsonl"
    os.utime(val)  # newer, same content: Snakemake compares the checksum it recorded, nothing to do
    assert "Nothing to be done" in (lambda o: o.stdout + o.stderr)(snakemake(wd, *args, check=True))
    val.write_text("".join(val.read_text().splitlines(keepends=True)[:-1]))  # an edit: the last row removed
    out = snakemake(wd, *args, check=True)
    text = out.stdout + out.stderr
    # the tiny model's tokenizer and warm-up read both files, so the edit reaches init_policy
    assert job_stats(text) == {"init_policy": 1, "train_epoch": EPOCHS, "archive_rollouts": EPOCHS,
                               "validate_init": 1, "validate_epoch": EPOCHS, "evaluate": 1, "report": 1, "all": 1}
    assert "Updated input files: data/addition/val.jsonl" in text, text[-3000:]


def test_revalidate_command_of_the_readme_redraws_the_report(reference_run, tmp_path):
    """docs/workflow.md, rerun (b): forcing one checkpoint's validation re-validates it, re-evaluates (the
    best checkpoint is picked by validation accuracy) and redraws the report, in one invocation;
    then nothing is left to do (a plain `--force` of the file would leave the evaluation and the
    report for a second invocation)."""
    wd = copy_run(reference_run, tmp_path / "wd")
    before = _mtimes(wd)
    args = ["--cores", "2", *short_config(), "--forcerun", f"results/{RUN}/epoch_1/validation.json"]
    out = snakemake(wd, *args, check=True)
    text = out.stdout + out.stderr
    assert job_stats(text) == {"validate_epoch": 1, "evaluate": 1, "report": 1, "all": 1}, text[-3000:]
    assert _changed(before, wd) == {"validation_1", "evaluation", "report"}
    _final_line_is_current(wd, text)
    again = snakemake(wd, "-n", "--cores", "2", *short_config(), check=True)
    assert "Nothing to be done" in again.stdout + again.stderr, again.stdout[-3000:]
