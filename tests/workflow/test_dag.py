"""The workflow without running jobs: lint, the default DAG, and parse-time errors reaching the
terminal as one paragraph (the unit tier checks every workflow-config error of `load_workflow`)."""

from __future__ import annotations

import re

from tests.helpers.workflow import ROOT, RUN, job_stats, make_workdir, short_config, snakemake

# the short recipe's stages (2 epochs); the embedded default has 3 epochs (grpo.max_num_epochs)
DEFAULT_JOBS = {"validate_recipe": 1, "init_policy": 1, "train_epoch": 2, "archive_rollouts": 2, "validate_init": 1,
                "validate_epoch": 2, "evaluate": 1, "report": 1, "all": 1}
THREE_EPOCHS = {**DEFAULT_JOBS, "train_epoch": 3, "archive_rollouts": 3, "validate_epoch": 3}


def test_lint_is_clean(tmp_path):
    out = snakemake(make_workdir(tmp_path), "--lint")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Lints for" not in out.stdout + out.stderr


def test_dry_run_of_the_default_lists_every_stage(tmp_path):
    out = snakemake(make_workdir(tmp_path), "-n", "--cores", "2")  # config/config.yaml: the embedded default
    assert out.returncode == 0, out.stderr
    assert job_stats(out.stdout) == THREE_EPOCHS
    for path in ("results/tiny-addition/epoch_3/checkpoint", "results/tiny-addition/epoch_1/rollouts.h5",
                 "results/tiny-addition/evaluation.json", "results/tiny-addition/report.html"):
        assert path in out.stdout


def test_dry_run_of_the_short_recipe_and_the_slurm_profile(tmp_path):
    wd = make_workdir(tmp_path)
    out = snakemake(wd, "-n", "--profile", str(ROOT / "profiles" / "slurm"), *short_config())
    assert out.returncode == 0, out.stderr
    assert job_stats(out.stdout) == DEFAULT_JOBS
    assert "slurm_partition=debug" in out.stdout


def test_dry_run_of_a_recipe_that_generates_its_data(tmp_path):
    """`data.generate` (recipes/tiny-reasoning-gym.yaml): a make_data stage writes the task's
    files under results/<run>/data/ (`run` defaults to the recipe's run_name) before the stages
    that read them."""
    out = snakemake(make_workdir(tmp_path), "-n", "--cores", "2", "--config", "recipe=recipes/tiny-reasoning-gym.yaml")
    assert out.returncode == 0, out.stderr
    assert job_stats(out.stdout) == {**DEFAULT_JOBS, "make_data": 1, "train_epoch": 1, "archive_rollouts": 1,
                                     "validate_epoch": 1}
    for path in ("results/tiny-reasoning-gym/data/train.jsonl", "results/tiny-reasoning-gym/data/generate.json"):
        assert path in out.stdout
    assert not (tmp_path / "results" / "tiny-reasoning-gym" / "data").exists()  # a dry run writes no data


def _fails_at_parse_time(tmp_path, *args) -> str:
    out = snakemake(make_workdir(tmp_path), "-n", "--cores", "2", *args)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "Traceback" not in text and "Building DAG" not in text, text  # stops before any job is planned
    return text


def test_unknown_recipe_fails_clearly(tmp_path):
    text = _fails_at_parse_time(tmp_path, "--config", "recipe=recipes/nope.yaml")
    assert ("rl_core workflow: Recipe error in the workflow config" in text and "field `recipe` got "
            "'recipes/nope.yaml'" in text and "recipes/tiny-addition.yaml" in text and "Fix:" in text)


def test_missing_data_file_fails_clearly(tmp_path):
    text = _fails_at_parse_time(tmp_path, *short_config(RUN, ["data.train_file=data/nope.jsonl"]))
    assert "field `data.train_file` got 'data/nope.jsonl'" in text and "an existing JSON-lines file" in text


SUBMITTING_RULES = ("train_epoch", "evaluate")


def test_computing_rules_declare_benchmarks_and_resources(tmp_path):
    """Every rule that computes has a `benchmark:` file and declares `mem_mb` and `runtime` where
    Snakemake (and the Slurm executor) can see them: the dry run's job blocks show both.
    `train_epoch` and `evaluate` only submit and wait (docs/workflow.md): their resource is the
    launcher; the controller job's and the evaluation array's come from the recipe's `cluster:`."""
    out = snakemake(make_workdir(tmp_path), "-n", "--cores", "2", *short_config())
    assert out.returncode == 0, out.stderr
    blocks = re.split(r"^(?:local)?rule ", out.stdout, flags=re.M)[1:]
    seen = set()
    for block in blocks:
        rule = block.split(":", 1)[0]
        if rule in ("validate_recipe", "all"):  # writes resolved_config.json / prints the summary
            continue
        seen.add(rule)
        wildcards = re.search(r"^\s+wildcards: epoch=(\d+)$", block, flags=re.M)
        name = f"{rule}_{wildcards.group(1)}" if wildcards else rule
        assert f"benchmark: results/{RUN}/benchmarks/{name}.tsv" in block, block
        resources = re.search(r"^\s+resources: (.*)$", block, flags=re.M)
        assert resources, block
        if rule in SUBMITTING_RULES:  # local rules that wait for a submitit job (its resources: `cluster:`)
            assert "launcher=local" in resources.group(1), block
        else:
            assert "mem_mb=" in resources.group(1) and "runtime=" in resources.group(1), block
    assert seen == set(DEFAULT_JOBS) - {"validate_recipe", "all"}
