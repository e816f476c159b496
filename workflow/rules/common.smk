# Parse time: check the workflow config against workflow/schemas/config.schema.yaml, load
# the recipe, plan the epochs. Any problem stops here with one paragraph (no jobs run).
import sys
from pathlib import Path

from rl_core.errors import UserError
from rl_core.launch.workflow import load_workflow

try:
    WF = load_workflow(config, Path(workflow.basedir) / "workflow" / "schemas" / "config.schema.yaml")
except UserError as exc:
    sys.exit(f"rl_core workflow: {exc}")


wildcard_constraints:
    epoch=r"[1-9][0-9]*",


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


rule init_policy:
    input:
        config=ancient(WF.resolved),
    output:
        directory(WF.init_policy),
    params:
        recipe_digest=WF.digest("init"),
    threads: 2
    conda:
        "../envs/rl_core.yaml"
    log:
        f"{WF.run_dir}/logs/init_policy.log",
    script:
        "../scripts/init_policy.py"
