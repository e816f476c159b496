"""The workflow's parse-time plan: workflow config schema, recipe loading, epochs, branching."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_core.errors import RecipeError
from rl_core.launch.branch import branch_epoch
from rl_core.launch.workflow import WorkflowPlan, load_workflow, recipe_chain

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
SHORT = "recipes/tiny-addition-short.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)


def _load(**config) -> WorkflowPlan:
    base = {"recipe": SHORT, "run": "t", "overrides": [], "launcher": "auto", "branch_from": None}
    base.update(config)
    return load_workflow({k: v for k, v in base.items() if v is not ...}, SCHEMA)


def test_plan_of_the_short_recipe():
    wf = _load()
    assert wf.num_epochs == 2 and [e["end_step"] for e in wf.epochs] == [6, 12]
    assert wf.cfg.run_name == "t" and wf.cfg.output_dir == "results"
    assert wf.prev_checkpoint(1) == "results/t/init_policy" and wf.prev_checkpoint(2) == "results/t/epoch_1/checkpoint"
    assert wf.per_epoch("validation.json") == ["results/t/epoch_1/validation.json", "results/t/epoch_2/validation.json"]
    assert wf.trained_epochs() == [1, 2] and wf.branched_epochs() == []
    assert wf.recipe_files == [SHORT, "recipes/tiny-addition.yaml"] == recipe_chain(SHORT)
    assert WorkflowPlan.epoch_regex([3, 4]) == "3|4"


def test_run_defaults_to_the_recipes_run_name():
    """config/config.yaml's `run: null` (or no `run`): outputs go under the recipe's run_name, so
    `--config recipe=...` alone never writes into another recipe's results."""
    assert _load(run=None).run == "tiny-addition-short"
    assert _load(run=...).run == "tiny-addition-short"
    assert _load(run=None, overrides=["run_name=mine"]).run == "mine"
    assert _load(run=None).prev_checkpoint(1) == "results/tiny-addition-short/init_policy"
    assert _load(run="t").run == "t"


def test_auto_launcher_follows_the_snakemake_executor():
    class Plugin:
        def __init__(self, name):
            self.name = name

    auto = _load()
    assert auto.job_launcher(None) == "local" and auto.job_launcher(Plugin("local")) == "local"
    assert auto.job_launcher(Plugin("slurm")) == "slurm" and auto.job_launcher(Plugin("slurm-jobstep")) == "slurm"
    assert _load(launcher="local").job_launcher(Plugin("slurm")) == "local"
    assert _load(launcher="slurm").job_launcher(None) == "slurm"


def test_overrides_change_the_plan():
    wf = _load(overrides=["grpo.max_num_epochs=3", "grpo.max_num_steps=100"])
    assert wf.num_epochs == 3


@pytest.mark.parametrize("config, field, text", [
    ({"recipe": "recipes/nope.yaml"}, "recipe", "an existing recipe file"),
    ({"run": "a b"}, "run", "a string matching"),
    ({"launcher": "pbs"}, "launcher", "one of ['auto', 'local', 'slurm']"),
    ({"overrides": "trainer.lr=1"}, "overrides", "JSON type array"),
    ({"overrides": ["no_equals_sign"]}, "overrides.0", "a string matching"),
    ({"surprise": 1}, "surprise", "only the known keys"),
    ({"recipe": ...}, "recipe", "(missing)"),
])
def test_bad_workflow_config_names_the_field(config, field, text):
    with pytest.raises(RecipeError) as info:
        _load(**config)
    msg = str(info.value)
    assert f"field `{field}`" in msg and text in msg and "Fix:" in msg and "workflow config" in msg


def test_bad_recipe_values_and_missing_files_fail_at_parse_time(tmp_path):
    with pytest.raises(RecipeError, match=r"field `trainer.lr` got -1"):
        _load(overrides=["trainer.lr=-1"])
    with pytest.raises(RecipeError, match=r"field `data.val_file` got '/nope.jsonl'.*Fix:"):
        _load(overrides=["data.val_file=/nope.jsonl"])
    with pytest.raises(RecipeError, match=r"field `evaluation.sets.hard` got '/nope/hard.jsonl'"):
        _load(overrides=["evaluation.sets={hard: /nope/hard.jsonl}"])


def test_branch_from_is_checked_at_parse_time(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("recipes", "data"):
        (tmp_path / name).symlink_to(ROOT / name)
    with pytest.raises(RecipeError, match=r"field `branch_from`.*a finished epoch"):
        _load(branch_from="results/base/epoch_1")
    ck = tmp_path / "results" / "base" / "epoch_1" / "checkpoint"
    ck.mkdir(parents=True)
    (ck / "manifest.json").write_text("{}")
    with pytest.raises(RecipeError, match=r"field `branch_from`.*init_policy/model.safetensors is missing"):
        _load(run="b2", branch_from="results/base/epoch_1")
    init = tmp_path / "results" / "base" / "init_policy"
    init.mkdir()
    (init / "model.safetensors").write_bytes(b"x")
    wf = _load(run="b2", branch_from="results/base/epoch_1/")
    assert wf.source_init_policy() == "results/base/init_policy"
    assert wf.branch_epoch == 1 and wf.trained_epochs() == [2] and wf.branched_epochs() == [1]
    assert wf.source_epoch_dir(1) == "results/base/epoch_1"
    with pytest.raises(RecipeError, match="another run"):
        _load(run="base", branch_from="results/base/epoch_1")
    with pytest.raises(RecipeError, match="an epoch before this run's last one"):
        _load(run="b2", branch_from="results/base/epoch_1", overrides=["grpo.max_num_epochs=1"])
    with pytest.raises(RecipeError, match="results/<run>/epoch_<k>"):
        _load(run="b2", branch_from="results/base")


def test_a_branch_reuses_the_source_results_that_still_hold(tmp_path, monkeypatch):
    """The archive of a linked epoch is always the source's; a validation only when the source made it
    with the branch's validation knobs (the same digest file) and it is up to date there."""
    monkeypatch.chdir(tmp_path)
    for name in ("recipes", "data"):
        (tmp_path / name).symlink_to(ROOT / name)
    _load(run="base").write_stage_digests()  # the source run's digests, then its results
    base = tmp_path / "results" / "base"
    (base / "epoch_1" / "checkpoint").mkdir(parents=True)
    (base / "epoch_1" / "checkpoint" / "manifest.json").write_text("{}")
    (base / "init_policy").mkdir()
    (base / "init_policy" / "model.safetensors").write_bytes(b"x")
    for rel in ("epoch_1/rollouts.h5", "epoch_1/validation.json", "init_validation.json"):
        (base / rel).write_text("{}")
    branch = _load(run="b", branch_from="results/base/epoch_1", overrides=["trainer.lr=3e-4"])
    branch.write_stage_digests()
    assert (branch.reused_archives(), branch.reused_validations(), branch.reuses_init_validation()) == ([1], [1], True)
    assert branch.epochs_but(branch.reused_validations()) == [2]
    other = _load(run="c", branch_from="results/base/epoch_1", overrides=["validation.max_val_samples=8"])
    other.write_stage_digests()  # other validation knobs: validate again, but the archive is the same
    assert (other.reused_archives(), other.reused_validations(), other.reuses_init_validation()) == ([1], [], False)
    stale = base / "epoch_1" / "validation.json"
    os.utime(stale, ns=(1, 1))  # older than the source's digest: the source itself would rerun it
    assert branch.reused_validations() == [] and branch.reuses_init_validation()
    (base / "epoch_1" / "rollouts.h5").unlink()  # not archived there (yet): archived here from the spool
    assert branch.reused_archives() == [] and branch.epochs_but(branch.reused_archives()) == [1, 2]


def test_branch_epoch_links_a_verified_checkpoint(tmp_path):
    from rl_core.checkpoint import write_checkpoint
    from rl_core.errors import CheckpointError

    src = tmp_path / "results" / "base" / "epoch_1"
    write_checkpoint(src / "checkpoint", lambda d: (d / "model.bin").write_bytes(b"w" * 100), {"rl_step": 6})
    (src / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    (src / "summary.json").write_text(json.dumps({"rl_steps": 6}))
    (src / "rollouts.spool").mkdir()
    (src / "rollouts.spool" / "step_000000.json").write_text("{}")
    (src / "validation.json").write_text("{}")
    (src / "steps").mkdir()
    (src / "checkpoint" / ".snakemake_timestamp").write_text("")  # Snakemake's marker of the directory output
    dst = tmp_path / "results" / "b" / "epoch_1"
    branch_epoch(str(src), str(dst))
    assert sorted(p.name for p in dst.iterdir()) == ["checkpoint", "metrics.jsonl", "rollouts.spool", "summary.json"]
    # write-once payloads are linked; what Snakemake touches or rl_core appends to is the branch's own
    assert (dst / "checkpoint" / "model.bin").stat().st_ino == (src / "checkpoint" / "model.bin").stat().st_ino
    spool = "rollouts.spool/step_000000.json"
    assert (dst / spool).stat().st_ino == (src / spool).stat().st_ino
    for rel in ("summary.json", "metrics.jsonl", "checkpoint/.rl_core-output"):
        assert (dst / rel).read_bytes() == (src / rel).read_bytes()
        assert (dst / rel).stat().st_ino != (src / rel).stat().st_ino, rel
    assert not (dst / "checkpoint" / ".snakemake_timestamp").exists()  # Snakemake writes the branch's own
    old = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in src.rglob("*") if p.is_file()}
    os.utime(dst / "summary.json", ns=(1, 1))  # what Snakemake does to the rule's outputs after the job
    (dst / "checkpoint" / ".snakemake_timestamp").write_text("")
    with open(dst / "metrics.jsonl", "a") as fh:  # what the metrics logger does
        fh.write('{"kind": "train", "step": 2}\n')
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in old} == old
    with open(src / "checkpoint" / "model.bin", "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(CheckpointError, match=r"model.bin has 10 bytes; the manifest says 100"):
        branch_epoch(str(src), str(tmp_path / "results" / "c" / "epoch_1"))


def test_parse_time_modules_do_not_import_torch():
    code = ("import sys, rl_core.launch.workflow, rl_core.launch.stages, rl_core.config; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_final_summary_names_accuracy_and_report(tmp_path, monkeypatch):
    from rl_core.launch.workflow import final_summary

    wf = _load()
    monkeypatch.chdir(tmp_path)
    assert final_summary(wf) is None  # nothing run yet
    (tmp_path / "results/t/epoch_2").mkdir(parents=True)
    (tmp_path / "results/t/init_validation.json").write_text(json.dumps({"accuracy": 0.125}))
    (tmp_path / "results/t/epoch_2/validation.json").write_text(json.dumps({"accuracy": 0.5}))
    (tmp_path / "results/t/report.html").write_text("<html>")
    assert final_summary(wf) == ("held-out accuracy: 0.125 before RL -> 0.500 after 12 RL steps (+37.5 points)\n"
                                 "report: results/t/report.html")


def test_stage_digests_follow_only_what_each_stage_depends_on():
    base = _load()
    lr = _load(overrides=["trainer.lr=3e-4"])
    ev = _load(overrides=["evaluation.num_generations_per_prompt=8"])
    val = _load(overrides=["validation.max_val_samples=10"])
    cl = _load(overrides=["cluster.controller.mem_gb=64"])
    assert lr.digest("train") != base.digest("train")
    assert lr.digest("init") == lr.digest("init") == base.digest("init")
    assert lr.digest("validate") == base.digest("validate") and lr.digest("evaluate") == base.digest("evaluate")
    assert ev.digest("evaluate") != base.digest("evaluate") and ev.digest("train") == base.digest("train")
    # a validation knob re-validates; it does not retrain (held-out validation is its own stage)
    assert val.digest("validate") != base.digest("validate") and val.digest("train") == base.digest("train")
    assert all(cl.digest(s) == base.digest(s) for s in ("init", "train", "validate", "evaluate"))
    assert _load(run="other").digest("train") == base.digest("train")


def test_stage_digest_files_move_only_on_a_real_change(tmp_path, monkeypatch):
    base, cl, val = _load(), _load(overrides=["cluster.controller.mem_gb=64"]), _load(overrides=["validation.max_val_samples=10"])
    monkeypatch.chdir(tmp_path)
    assert sorted(Path(p).name for p in base.write_stage_digests()) == ["evaluate.json", "init.json", "train.json",
                                                                     "validate.json"]
    files = {s: Path(base.stage_digest(s)) for s in ("init", "train", "validate", "evaluate")}
    for f in files.values():
        os.utime(f, ns=(1_000_000_000, 1_000_000_000))  # long ago
    assert base.write_stage_digests() == [] and cl.write_stage_digests() == []
    assert json.loads(files["train"].read_text())["digest"] == base.digest("train")
    # a validation knob moves only the validation stage's file
    assert val.write_stage_digests() == [str(files["validate"])]
    assert {s for s, f in files.items() if f.stat().st_mtime_ns != 1_000_000_000} == {"validate"}
    assert json.loads(files["validate"].read_text())["sections"]["validation"]["max_val_samples"] == 10
    assert not list(Path(base.run_dir, ".stage-digests").glob(".*tmp*"))  # written atomically, nothing left over
