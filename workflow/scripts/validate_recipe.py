"""Rule validate_recipe: recipe + overrides -> results/<run>/resolved_config.json."""
from rl_core.launch import stages
from rl_core.launch.workflow import run_in_rule

smk = snakemake  # noqa: F821 - injected by Snakemake
run_in_rule(smk, lambda: stages.validate_recipe(smk.input.recipe, smk.params.run, list(smk.params.overrides),
                                                smk.output[0]))
