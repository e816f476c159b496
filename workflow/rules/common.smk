# Parse time: check the workflow config against workflow/schemas/config.schema.yaml, load
# the recipe, plan the epochs. Any problem stops here with one paragraph (no jobs run).
import sys
from pathlib import Path

from rl_core.errors import UserError
from rl_core.launch.workflow import load_workflow

try:
    WF = load_workflow(config, Path(workflow.basedir) / "workflow" / "schemas" / "config.schema.yaml",
                       command_line=workflow.config_settings.overwrite_config)  # what --config gave
except UserError as exc:
    sys.exit(f"rl_core workflow: {exc}")
# `run: null` means the recipe's run_name: record the name in use for the jobs and the report
config["run"] = WF.run

# Change detection: one digest file per stage (results/<run>/.stage-digests/<stage>.json, the
# recipe values the stage's result depends on), rewritten only when its content changes; each
# stage's rules take it as a normal input, so Snakemake's mtime check reruns exactly the stages
# a changed knob can affect, and the DAG reruns what follows them (rl_core/launch/workflow.py,
# WorkflowPlan.write_stage_digests, says why not params).
WF.write_stage_digests()


wildcard_constraints:
    epoch=r"[1-9][0-9]*",


# The run's recipe of record (every knob, for people and for `rl-core serve/inspect`). No stage
# reads it (each job resolves the same recipe from the workflow config: stage_config), so it is
# not upstream of the stages and rewriting it reruns nothing else.
rule validate_recipe:
    localrule: True
    input:
        recipe=WF.recipe,
        extends=WF.recipe_files[1:],
    output:
        WF.resolved,
    params:
        run=WF.run,
        overrides=WF.overrides,
    conda:
        "../envs/rl_core.yaml"
    log:
        f"{WF.run_dir}/logs/validate_recipe.log",
    script:
        "../scripts/validate_recipe.py"


# `data.generate` (a reasoning_gym task): the task's train and held-out sets, generated with
# seeds into results/<run>/data/ (byte-identical for the same recipe values).
if WF.generated_data:

    rule make_data:
        input:
            digest=WF.stage_digest("data"),
        output:
            WF.generated_data,
        resources:
            mem_mb=2000,
            runtime=30,
        conda:
            "../envs/rl_core.yaml"
        log:
            f"{WF.run_dir}/logs/make_data.log",
        benchmark:
            f"{WF.run_dir}/benchmarks/make_data.tsv"
        script:
            "../scripts/make_data.py"


if not WF.branch_from:

    rule init_policy:
        input:
            digest=WF.stage_digest("init"),
            data=WF.data_inputs("init"),
        output:
            directory(WF.init_policy),
        threads: 2
        resources:
            mem_mb=4000,
            runtime=60,
        conda:
            "../envs/rl_core.yaml"
        log:
            f"{WF.run_dir}/logs/init_policy.log",
        benchmark:
            f"{WF.run_dir}/benchmarks/init_policy.tsv"
        script:
            "../scripts/init_policy.py"
